"""Triton kernels against their torch twins (``services/kernels/torch_backend.py``).

Without CUDA the kernels run in Triton's interpreter, so shapes stay small; the
interpreter's bf16 arithmetic is wrong, so bf16 is covered on a GPU only (see
``bench/kernels_gpu.py``).
"""

import math

import pytest
import torch

from services.kernels import torch_backend as ref
from services.kernels.metadata import AttentionMetadata
from services.kernels.triton_attention import choose_num_splits, decode_attention
from services.kernels.triton_backend import TritonBackend
from services.kernels.triton_extend import extend_attention
from services.kernels.triton_kv import write_kv
from services.kernels.triton_norm import rms_norm
from services.kernels.triton_rotary import rotary

pytestmark = pytest.mark.triton
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 16  # block_size used throughout
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 3e-3, "rtol": 3e-3}}
if torch.cuda.is_available():
    TOL[torch.bfloat16] = {"atol": 2e-2, "rtol": 2e-2}
DTYPES = list(TOL)


def make_meta(
    query_lens: list[int], seq_lens: list[int], num_blocks: int, gen: torch.Generator
) -> AttentionMetadata:
    """Metadata over randomly scattered blocks, with a strided (non-contiguous) block table."""
    b = len(seq_lens)
    width = max([math.ceil(s / PAGE) for s in seq_lens] + [1])
    wide = torch.zeros(b, width + 3, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    used = 0
    for i, s in enumerate(seq_lens):
        n = math.ceil(s / PAGE)
        wide[i, 3 : 3 + n] = ids[used : used + n].to(torch.int32)
        used += n
    table = wide.to(DEV)[:, 3:]  # row stride width + 3: not contiguous
    slots = [
        int(table[i, p // PAGE]) * PAGE + p % PAGE
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for p in range(s - q, s)
    ]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    i32 = {"dtype": torch.int32, "device": DEV}
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def make_cache(hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator, num_blocks: int = 40):
    shape = (num_blocks, PAGE, hkv, d)
    k = torch.randn(shape, generator=gen).to(DEV, dtype)
    v = torch.randn(shape, generator=gen).to(DEV, dtype)
    return k, v


# Lengths 1, block_size - 1, block_size, block_size + 1, odd, and one past a split.
DECODE_LENS = [1, PAGE - 1, PAGE, PAGE + 1, 37, 150]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_twin(dtype: torch.dtype, group: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(group * 10 + num_splits)
    hkv, d = 2, 64
    meta = make_meta([1] * len(DECODE_LENS), DECODE_LENS, 40, gen)
    k, v = make_cache(hkv, d, dtype, gen)
    q = torch.randn(len(DECODE_LENS), hkv * group, d, generator=gen).to(DEV, dtype)
    want = ref.attention(q, k, v, meta, d**-0.5)
    got = decode_attention(
        q, k, v, meta.block_tables, meta.seq_lens, meta.max_seq_len, d**-0.5, num_splits
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_decode_head_dim_128_strided_query() -> None:
    gen = torch.Generator().manual_seed(7)
    hkv, group, d = 1, 4, 128
    meta = make_meta([1, 1, 1], [PAGE + 1, 1, 70], 20, gen)
    k, v = make_cache(hkv, d, torch.float16, gen, 20)
    qkv = torch.randn(3, (group + 2) * hkv, d, generator=gen).to(DEV, torch.float16)
    q = qkv[:, : group * hkv]  # a view, as the model passes it
    want = ref.attention(q, k, v, meta, 0.1)
    for splits in (1, 2):
        got = decode_attention(
            q, k, v, meta.block_tables, meta.seq_lens, meta.max_seq_len, 0.1, splits
        )
        torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_split_k_is_chosen_for_long_contexts_and_small_batches() -> None:
    assert choose_num_splits(1, 8, 32768, DEV) > 1
    assert choose_num_splits(256, 8, 32768, DEV) == 1
    assert choose_num_splits(4, 8, 100, DEV) == 1
    gen = torch.Generator().manual_seed(3)
    meta = make_meta([1], [600], 40, gen)  # auto: 3 splits on a nominal 132-SM device
    k, v = make_cache(2, 64, torch.float32, gen)
    q = torch.randn(1, 4, 64, generator=gen).to(DEV)
    got = TritonBackend.attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(got, ref.attention(q, k, v, meta, 0.125), **TOL[torch.float32])


# (new query rows, context length): single token, block edges, prefix-cache hits
# (query shorter than context), an idle sequence and a decode row mixed into prefill.
EXTEND_CASES = [
    (1, 1),
    (PAGE - 1, PAGE - 1),
    (PAGE, PAGE),
    (PAGE + 1, PAGE + 1),
    (5, 37),
    (0, 9),
    (1, 20),
    (33, 50),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_extend_attention_matches_twin(dtype: torch.dtype, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    hkv, d = 2, 64
    qlens, slens = zip(*EXTEND_CASES, strict=True)
    meta = make_meta(list(qlens), list(slens), 40, gen)
    k, v = make_cache(hkv, d, dtype, gen)
    q = torch.randn(sum(qlens), hkv * group, d, generator=gen).to(DEV, dtype)
    want = ref.attention(q, k, v, meta, d**-0.5)
    got = TritonBackend.attention(q, k, v, meta, d**-0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])
    got = extend_attention(
        q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, d**-0.5
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_attention_empty_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = make_meta([], [], 4, gen)
    k, v = make_cache(2, 64, torch.float16, gen, 4)
    q = torch.empty(0, 4, 64, dtype=torch.float16, device=DEV)
    assert TritonBackend.attention(q, k, v, meta, 1.0).shape == (0, 4, 64)
    assert extend_attention(
        q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0, 1.0
    ).shape == (0, 4, 64)
    assert decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0, 1.0).shape == (0, 4, 64)


def test_attention_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = make_meta([1], [5], 4, gen)
    k, v = make_cache(2, 64, torch.float16, gen, 4)
    q = torch.randn(1, 3, 64).to(DEV, torch.float16)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        TritonBackend.attention(q, k, v, meta, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(q[:, :2], k, v, meta.block_tables.long(), meta.seq_lens, 5, 1.0)


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv_matches_twin(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    t, hkv, d = 9, 2, 64
    qkv = torch.randn(t, 4 * hkv, d, generator=gen).to(DEV)  # fp32 rows, cast on write
    key, value = qkv[:, 2 * hkv : 3 * hkv], qkv[:, 3 * hkv :]
    slots = torch.randperm(6 * PAGE, generator=gen)[:t].to(DEV)
    slots[[2, 5]] = -1  # padding rows are skipped
    k0, v0 = make_cache(hkv, d, cache_dtype, gen, 6)
    k1, v1 = k0.clone(), v0.clone()
    ref.write_kv(key, value, k0, v0, slots)
    write_kv(key, value, k1, v1, slots)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    write_kv(key[:0], value[:0], k1, v1, slots[:0])  # empty step: no-op
    assert torch.equal(k0, k1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_twin(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 2, 96, generator=gen).to(DEV, dtype)[:, 0]  # strided rows, odd width
    w = torch.randn(96, generator=gen).to(DEV, dtype)
    r = torch.randn(7, 96, generator=gen).to(DEV, dtype) if with_residual else None
    want, got = ref.rms_norm(x, w, 1e-6, r), rms_norm(x, w, 1e-6, r)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def rope_cache(
    rot: int, max_pos: int, base: float = 10000.0, linear_factor: float = 2.0
) -> torch.Tensor:
    """cos|sin table with linear rope scaling: the kernel only reads rows of it."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32) / linear_factor, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_matches_twin(dtype: torch.dtype, is_neox: bool, rot: int) -> None:
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 4, 2, 64
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(DEV, dtype)
    pos = torch.tensor([0, 3, 17, 99, 4], device=DEV)
    cache = rope_cache(rot, 128)
    q0, k0 = qkv[:, :hq].clone(), qkv[:, hq : hq + hkv].clone()
    ref.rotary(pos, q0, k0, cache, is_neox)
    q1, k1 = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views, rotated in place
    rotary(pos, q1, k1, cache, is_neox)
    torch.testing.assert_close(q1, q0, **TOL[dtype])
    torch.testing.assert_close(k1, k0, **TOL[dtype])
    assert torch.equal(qkv[:, hq + hkv :], qkv.clone()[:, hq + hkv :])


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 19])
def test_quantized_linear_matches_twin(method: str, m: int) -> None:
    """Codes read in their panels (40 outputs: a padded third panel; int4 groups of 32)."""
    from services.kernels.quant import quantize
    from services.kernels.triton_quant import quant_linear

    gen = torch.Generator().manual_seed(m)
    qw = quantize(torch.randn(40, 96, generator=gen), method).to(DEV)
    assert method == "int8" or qw.group == 32
    x = torch.randn(m, 96, generator=gen).to(DEV)
    bias = torch.randn(40, generator=gen).to(DEV)
    want = ref.linear(x, qw, bias)
    torch.testing.assert_close(quant_linear(x, qw, bias), want, **TOL[torch.float32])
    torch.testing.assert_close(
        TritonBackend().linear(x, qw), ref.linear(x, qw), **TOL[torch.float32]
    )


def test_int4_groups_the_kernel_does_not_take_go_through_the_twin() -> None:
    from services.kernels.quant import quantize
    from services.kernels.triton_quant import takes

    qw = quantize(torch.randn(16, 48), "int4")  # one group of 48 rows: not whole passes
    assert not takes(qw)
    x = torch.randn(3, 48)
    torch.testing.assert_close(TritonBackend().linear(x, qw), ref.linear(x, qw))
