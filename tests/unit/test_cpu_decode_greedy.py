"""The cpu backend's greedy burst (``decode_greedy``, csrc/epd_decode.c): several decode
steps in one native call give the tokens and K/V writes of as many rounds of embed,
``decode_stack`` and ``greedy_head``, bit for bit, at one thread and in a team; bad
tokens and short block tables are rejected before the native code reads memory; other
inputs are left to the caller's loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.cpu_backend import GEMV_MAX_ROWS
from services.kernels.metadata import AttentionMetadata
from services.kernels.torch_backend import TorchBackend
from tests.unit.test_cpu_decode_stack import CASES, _llm, _step, decode_meta

STEPS = 6


def _burst_meta(lens, steps, num_blocks, gen) -> tuple[AttentionMetadata, torch.Tensor]:
    """Step 0 of a burst: each sequence's block table already covers ``steps`` tokens."""
    return _step(lens, num_blocks, gen, width_pad=0, ahead=steps - 1)


def _one_on(meta: AttentionMetadata, s: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Step s of the burst as an ordinary decode step."""
    return decode_meta(meta.block_tables.tolist(), [n + s for n in meta.seq_lens_cpu])


def _parts(llm):
    model = llm.engine.model
    stack = model.model.native_stack(model.rope)
    return model, stack, model.model.embed_tokens.weight, model._head(), llm.engine.backend


@pytest.mark.parametrize(
    "kind,over", CASES, ids=[f"{k}{'-' if o else ''}{'-'.join(o)}" for k, o in CASES]
)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("layout", ["W^T", "W"])
def test_burst_matches_step_by_step(tiny_root, threads, kind, over, rows, layout):
    """The head as models keep it on CPU (W^T), or row-major (a tied head's layout)."""
    llm = _llm(tiny_root, kind, over)
    model, stack, embed, head, be = _parts(llm)
    head = head.t().contiguous().t() if layout == "W^T" else head.contiguous()
    kv = llm.engine.kv
    gen = torch.Generator().manual_seed(rows)
    lens = [int(x) for x in torch.randint(1, 30, (rows,), generator=gen)]
    meta, pos = _burst_meta(lens, STEPS, kv.num_blocks, gen)
    tokens = torch.randint(0, embed.shape[0], (rows,), generator=gen)
    base = [
        (torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen))
        for k, v in kv.layers
    ]
    caches_a = [(k.clone(), v.clone()) for k, v in base]
    caches_b = [(k.clone(), v.clone()) for k, v in base]
    with torch.inference_mode():
        burst = be.decode_greedy(stack, embed, head, tokens, pos, caches_a, meta, STEPS)
        want, t = [], tokens
        for s in range(STEPS):
            step, p = _one_on(meta, s)
            hidden = be.decode_stack(stack, p, F.embedding(t, embed), caches_b, step)
            t = be.greedy_head(hidden, head)
            want.append(t)
    assert burst is not None, "the native burst did not run"
    assert torch.equal(burst, torch.stack(want))
    for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_bad_tokens_and_short_tables_are_rejected(tiny_root, threads):
    llm = _llm(tiny_root, "llama", {})
    model, stack, embed, head, be = _parts(llm)
    kv = llm.engine.kv
    gen = torch.Generator().manual_seed(0)
    caches = [(k.clone(), v.clone()) for k, v in kv.layers]
    with torch.inference_mode():
        meta, pos = _burst_meta([5, 9], 3, kv.num_blocks, gen)
        for bad in (embed.shape[0], -1):
            with pytest.raises(IndexError, match="token id"):
                be.decode_greedy(stack, embed, head, torch.tensor([1, bad]), pos, caches, meta, 3)
        # The tables cover 3 steps, not 8: the step that would pass them is refused.
        with pytest.raises(ValueError, match="block table"):
            be.decode_greedy(stack, embed, head, torch.tensor([1, 2]), pos, caches, meta, 8)
        ok = be.decode_greedy(stack, embed, head, torch.tensor([1, 2]), pos, caches, meta, 3)
    assert ok is not None and ok.shape == (3, 2)


def test_left_to_the_callers_loop(tiny_root):
    """More rows than the GEMV takes, a head in neither GEMV layout, no steps, or the
    torch backend."""
    llm = _llm(tiny_root, "llama", {})
    model, stack, embed, head, be = _parts(llm)
    kv = llm.engine.kv
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        n = GEMV_MAX_ROWS + 1
        meta, pos = _burst_meta([3] * n, 2, kv.num_blocks, gen)
        assert (
            be.decode_greedy(
                stack, embed, head, torch.ones(n, dtype=torch.long), pos, kv.layers, meta, 2
            )
            is None
        )
        meta, pos = _burst_meta([3], 2, kv.num_blocks, gen)
        one = torch.ones(1, dtype=torch.long)
        strided = torch.randn(head.shape[0], 2 * head.shape[1])[:, ::2]
        assert be.decode_greedy(stack, embed, strided, one, pos, kv.layers, meta, 2) is None
        assert be.decode_greedy(stack, embed, head, one, pos, kv.layers, meta, 0) is None
        assert (
            TorchBackend().decode_greedy(stack, embed, head, one, pos, kv.layers, meta, 2) is None
        )
        assert be.decode_greedy(stack, embed, head, one, pos, kv.layers, meta, 2) is not None
