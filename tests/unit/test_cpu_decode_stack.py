"""The cpu backend's whole-step decode (``decode_stack``, csrc/epd_decode.c) against the
same model run layer by layer: identical hidden states and K/V writes at one thread (equal
within fp32 rounding for a team of threads), for every text architecture, with biases, per-head q/k norms and head sizes on and off the kernels'
fast paths; bad indices rejected before the native code reads memory; and the cases it
leaves to the layer-by-layer path."""

from __future__ import annotations

import pytest
import torch

from services import LLM
from services.kernels import kv_quant
from services.kernels.cpu_backend import GEMV_MAX_ROWS
from services.kernels.cpu_stack import NativeStack
from services.kernels.metadata import AttentionMetadata
from services.kernels.torch_backend import TorchBackend
from tests.helpers.checkpoints import TEXT_ARCHS, make_text_checkpoint

BLOCK = 4

# (architecture, checkpoint overrides): each reaches a different branch of the native step
CASES = [(kind, {}) for kind in TEXT_ARCHS] + [
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # o-proj and MLP biases
    ("qwen3", {"head_dim": 64}),  # the attention kernel's unrolled head size
]


def _llm(tiny_root, kind, over, quantization=None, kv_cache_dtype="auto") -> LLM:
    path = make_text_checkpoint(tiny_root, kind, seed=10 + len(over), **over)
    llm = LLM(
        str(path),
        block_size=BLOCK,
        num_kv_blocks=64,
        attention_backend="cpu",
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms are ones in a fresh checkpoint: make them count
        for name, p in llm.engine.model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return llm


def _step(
    seq_lens, num_blocks, gen, width_pad=1, ahead=0
) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode step: one new token per sequence, at the end of its context; each block
    table covers ``ahead`` more tokens (a burst's later steps)."""
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    rows, used = [], 0
    need = [-(-(s + ahead) // BLOCK) for s in seq_lens]
    width = max(need) + width_pad
    for n in need:
        rows.append(blocks[used : used + n] + [0] * (width - n))
        used += n
    return decode_meta(rows, seq_lens)


def decode_meta(rows: list[list[int]], seq_lens) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode step's metadata and positions for these block tables and lengths."""
    slots = [rows[i][(s - 1) // BLOCK] * BLOCK + (s - 1) % BLOCK for i, s in enumerate(seq_lens)]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return meta, torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64)


def _run(model, positions, h, caches, meta, fused: bool):
    backend = model.model.backend if hasattr(model, "model") else model.backend
    if fused:
        return model(positions, h, caches, meta)
    saved = backend.decode_stack
    backend.decode_stack = lambda *a: None
    try:
        return model(positions, h, caches, meta)
    finally:
        backend.decode_stack = saved


@pytest.mark.parametrize(
    "kind,over", CASES, ids=[f"{k}{'-' if o else ''}{'-'.join(o)}" for k, o in CASES]
)
@pytest.mark.parametrize("rows", [1, 4, 9])  # 9: the GEMV's column tiles
def test_fused_step_matches_layer_by_layer(tiny_root, threads, kind, over, rows):
    _check_fused_step(_llm(tiny_root, kind, over), rows, exact=threads == 1)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 7])
def test_fused_step_with_quantized_weights(tiny_root, threads, method, rows):
    # Each quantized output is summed whole by one thread: the same bits in a team too.
    _check_fused_step(_llm(tiny_root, "qwen3", {}, method), rows, exact=True)


@pytest.mark.parametrize(
    "kind,weights,fmt", [("llama", None, "int8"), ("qwen3", "int8", "int8"), ("llama", None, "fp8")]
)
@pytest.mark.parametrize("rows", [1, 7])
def test_fused_step_with_a_quantized_kv_cache(tiny_root, threads, kind, weights, fmt, rows):
    # The step writes rows with epd_kv_quantize, the layer path with kv_quant.quantize.
    llm = _llm(tiny_root, kind, {}, weights, kv_cache_dtype=fmt)
    assert kv_quant.format_of(llm.engine.kv.data) == fmt
    _check_fused_step(llm, rows, exact=threads == 1 or weights is not None)


def _random_cache(like: torch.Tensor, gen) -> torch.Tensor:
    if not kv_quant.is_quantized(like):
        return torch.randn(like.shape, generator=gen)
    d = kv_quant.head_dim(like)
    return kv_quant.quantize(
        torch.randn((*like.shape[:-1], d), generator=gen), kv_quant.format_of(like)
    )


def _check_fused_step(llm: LLM, rows: int, exact: bool) -> None:
    model, kv = llm.engine.model, llm.engine.kv
    gen = torch.Generator().manual_seed(rows)
    lens = [int(x) for x in torch.randint(1, 40, (rows,), generator=gen)]
    meta, positions = _step(lens, kv.num_blocks, gen)
    h = torch.randn(rows, model.config.hidden_size, generator=gen)
    base = [(_random_cache(k, gen), _random_cache(v, gen)) for k, v in kv.layers]
    caches_a = [(k.clone(), v.clone()) for k, v in base]
    caches_b = [(k.clone(), v.clone()) for k, v in base]
    calls = []
    lib = llm.engine.backend.lib
    native = lib.epd_par_decode_stack
    with torch.inference_mode():
        try:
            lib.epd_par_decode_stack = lambda *a: calls.append(1) or native(*a)
            fused = _run(model, positions, h, caches_a, meta, fused=True)
        finally:
            lib.epd_par_decode_stack = native
        ref = _run(model, positions, h, caches_b, meta, fused=False)
    assert calls, "the native step did not run"
    if exact:  # the same kernels in the same order: the same bits
        assert torch.equal(fused, ref)
        for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    else:  # a team splits each GEMV's rows: the sums' order differs
        torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-4)
        for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
            for a, b in ((ka, kb), (va, vb)):
                tol = {"atol": 1e-5, "rtol": 1e-4}
                if kv_quant.is_quantized(a):  # a code may round the other way: one step
                    a, b, tol = (
                        kv_quant.dequantize(a),
                        kv_quant.dequantize(b),
                        {"atol": 0.05, "rtol": 0},
                    )
                torch.testing.assert_close(a, b, **tol)


def test_bad_indices_are_rejected(tiny_root, threads):
    llm = _llm(tiny_root, "llama", {})
    model, kv = llm.engine.model, llm.engine.kv
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, model.config.hidden_size)
    caches = [(k.clone(), v.clone()) for k, v in kv.layers]
    with torch.inference_mode():
        meta, pos = _step([5, 9], kv.num_blocks, gen)
        with pytest.raises(IndexError, match="position"):
            model(torch.tensor([4, 10**6]), h, caches, meta)
        with pytest.raises(IndexError, match="position"):
            model(torch.tensor([-1, 8]), h, caches, meta)
        meta.slot_mapping = torch.tensor([3, kv.num_blocks * BLOCK])
        with pytest.raises(IndexError, match="slot"):
            model(pos, h, caches, meta)
        meta, pos = _step([5, 9], kv.num_blocks, gen)
        meta.block_tables[1, 0] = kv.num_blocks
        with pytest.raises(ValueError, match="block"):
            model(pos, h, caches, meta)
        meta, pos = _step([5, 9], kv.num_blocks, gen, width_pad=0)
        meta.seq_lens = torch.tensor([5, 9 + BLOCK], dtype=torch.int32)  # past its table
        with pytest.raises(ValueError, match="block table"):
            model(pos, h, caches, meta)
        # The engine still serves after the rejected steps.
        meta, pos = _step([5, 9], kv.num_blocks, gen)
        assert model(pos, h, caches, meta).shape == h.shape


def test_left_to_the_layer_path(tiny_root, one_thread):
    """More rows than the GEMV takes, a prefill row, or another dtype: no native step."""
    llm = _llm(tiny_root, "llama", {})
    model, kv, be = llm.engine.model, llm.engine.kv, llm.engine.backend
    stack = model.model.native_stack(model.rope)
    gen = torch.Generator().manual_seed(0)
    n = GEMV_MAX_ROWS + 1
    meta, pos = _step([3] * n, kv.num_blocks, gen)
    h = torch.randn(n, model.config.hidden_size)
    assert be.decode_stack(stack, pos, h, kv.layers, meta) is None
    meta, pos = _step([3], kv.num_blocks, gen)
    assert be.decode_stack(stack, pos, h[:1].double(), kv.layers, meta) is None
    assert be.decode_stack(stack, pos, h[:1], kv.layers, meta) is not None
    meta.max_query_len = 2
    assert be.decode_stack(stack, pos, h[:1], kv.layers, meta) is None
    assert TorchBackend().decode_stack(stack, pos, h[:1], kv.layers, meta) is None


def test_a_missing_teammate_fails_the_step(tiny_root):
    """A thread of the team that never comes: the others give up at the timeout with a
    clear error instead of waiting forever, and the next step runs."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = _llm(tiny_root, "llama", {})
        model, kv = llm.engine.model, llm.engine.kv
        stack = model.model.native_stack(model.rope)
        meta, pos = _step([5], kv.num_blocks, torch.Generator().manual_seed(0))
        h = torch.randn(1, model.config.hidden_size)
        lib = llm.engine.backend.lib
        native = NativeStack(lib, 4, cpus=2, team_timeout_ms=50)

        class OnlyTheFirst:  # the team's second thread never starts
            def __getattr__(self, name):
                return getattr(lib, name)

            def epd_par_decode_stack(self, *args):
                *step, nt, codes = args
                codes[0] = lib.epd_decode_stack(*step, 0, nt)

        with torch.inference_mode():
            native.lib = OnlyTheFirst()
            with pytest.raises(RuntimeError, match="never joined"):
                native.run(stack, pos, h, kv.layers, meta)
            native.lib = lib
            ok = native.run(stack, pos, h, kv.layers, meta)
        assert ok is not None and ok.shape == h.shape
    finally:
        torch.set_num_threads(old)
