"""The quantized KV caches' arithmetic (``services/kernels/kv_quant.py``, int8 and fp8)
and their native kernels (``csrc/epd_kvq8.c``).

Quantization: within half a step of every value (fp8: half a step of its exponent), a
zero vector stays zero, and the C writer stores the bytes the torch one does, fp8 ties,
subnormals and saturation included. Attention over a quantized cache, on the cpu
backend (native rows, SDPA for long chunks) and the torch backend, against torch's
attention over the same cache dequantized to fp32: decode rows, prefill chunks, GQA,
head sizes 64 and 128 (and one the native kernel does not take); a row's result does not
depend on the rows beside it.
"""

import pytest
import torch

from services.kernels import cpu_attention, kv_quant
from services.kernels import torch_backend as ref
from services.kernels.metadata import AttentionMetadata
from tests.unit.test_cpu_kernels import _meta

TOL = {"atol": 2e-5, "rtol": 1e-4}


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def test_int8_is_within_half_a_step_and_keeps_zero_vectors_zero():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=gen) * torch.rand(50, 4, 1, generator=gen) * 10
    x[3, 1] = 0
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 4, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    back = kv_quant.dequantize(rows)
    # half a step, plus the float rounding of x / scale and code * scale
    assert ((back - x).abs() <= scale / 2 + 1e-6 * x.abs()).all()
    assert (back[3, 1] == 0).all() and scale[3, 1].item() == 0
    assert rows[..., :64].abs().max() == 127


def test_fp8_is_within_half_a_step_of_each_exponent_and_keeps_zero_vectors_zero():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=gen) * torch.rand(50, 4, 1, generator=gen) * 10
    x[3, 1] = 0
    rows = kv_quant.quantize(x, "fp8")
    assert rows.dtype == torch.uint8 and rows.shape == (50, 4, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    back = kv_quant.dequantize(rows)
    # 3 mantissa bits: within 1/16 of the value, or half the subnormal step (2^-10 scale)
    bound = torch.maximum(x.abs() / 16, scale * 2.0**-10) + 1e-6 * x.abs()
    assert ((back - x).abs() <= bound).all()
    assert (back[3, 1] == 0).all() and scale[3, 1].item() == 0
    assert rows[..., :64].view(torch.float8_e4m3fn).float().abs().max() == 448


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_native_writer_stores_the_torch_bytes(be, fmt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 128, generator=gen) * 3
    x[7] = 0
    x[8] = torch.randn(128, generator=gen) * 1e-4
    x[8, :3] = torch.tensor([-0.0, -1e-30, 1e-30])
    top = kv_quant.FORMATS[fmt][1]
    # row 9's scale is 1: ties round to even both ways (int8 at .5, fp8 between codes)
    ties = [1.0, -1.0, 0.5, -0.5, 17.0, 19.0, -(2.0**-10), 3 * 2.0**-10, 2.0**-6 - 2.0**-10]
    x[9, : len(ties) + 1] = torch.tensor([top, *ties])
    x[9, len(ties) + 1 :] = 0.25
    got = torch.empty(300, 132, dtype=kv_quant.FORMATS[fmt][0])
    be.lib.epd_kv_quantize(_ptr(got), _ptr(x), 300, 128, fmt == "fp8")
    assert torch.equal(got, kv_quant.quantize(x, fmt))


def _quantized_case(query_lens, seq_lens, hq, hkv, d, seed, fmt="int8", bs=16):
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // bs) for s in seq_lens) + 8
    meta = _meta(query_lens, seq_lens, nb, bs, gen)
    kc = kv_quant.quantize(torch.randn(nb, bs, hkv, d, generator=gen), fmt)
    vc = kv_quant.quantize(torch.randn(nb, bs, hkv, d, generator=gen), fmt)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    return q, kc, vc, meta


CASES = [
    # decode rows only; a prefill beside decodes; a chunk past ROW_EXTEND_MAX (SDPA)
    ([1, 1, 1], [5, 40, 17], 4, 4, 64),
    ([1, 9, 1, 20], [33, 9, 1, 70], 8, 2, 64),
    ([1, 30], [12, cpu_attention.ROW_EXTEND_MAX + 100], 4, 1, 128),
    ([3, 1], [19, 64], 6, 3, 24),
    ([2, 1], [7, 30], 2, 1, 20),  # d % 8 != 0: torch's attention over the dequantized rows
]


@pytest.mark.parametrize("query_lens,seq_lens,hq,hkv,d", CASES)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_attention_over_a_quantized_cache_is_that_over_its_values(
    be, query_lens, seq_lens, hq, hkv, d, backend, fmt
):
    seed = len(seq_lens) + d
    q, kc, vc, meta = _quantized_case(query_lens, seq_lens, hq, hkv, d, seed, fmt)
    scale = d**-0.5
    attend = be.attention if backend == "cpu" else ref.attention
    got = attend(q, kc, vc, meta, scale)
    want = ref.attention(q, kv_quant.dequantize(kc), kv_quant.dequantize(vc), meta, scale)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_decode_row_does_not_depend_on_its_batch(be, fmt):
    q, kc, vc, meta = _quantized_case([1, 1, 1, 1], [50, 3, 77, 20], 8, 2, 64, 5, fmt)
    together = be.attention(q, kc, vc, meta, 0.125)
    for b in range(4):
        n = meta.seq_lens_cpu[b]
        one = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=meta.block_tables[b : b + 1],
            slot_mapping=torch.zeros(1, dtype=torch.int64),
            max_query_len=1,
            max_seq_len=n,
            query_lens_cpu=[1],
            seq_lens_cpu=[n],
        )
        alone = be.attention(q[b : b + 1].clone(), kc, vc, one, 0.125)
        assert torch.equal(alone[0], together[b])


def test_native_rows_are_planned_for_a_quantized_cache(be):
    q, kc, vc, meta = _quantized_case([1, 9], [33, 9], 8, 2, 64, seed=2)
    be.attention(q, kc, vc, meta, 0.125)
    plan = be._plan[1]
    assert plan.num_rows == 10 and plan.units.shape[0] == 0 and plan.sdpa_meta is None


def test_blocks_of_another_kv_cache_dtype_are_refused():
    from services.engine.kv_cache import KVCachePool

    int8 = KVCachePool(2, 8, 4, 2, 16, torch.int8, "cpu")
    fp8 = KVCachePool(2, 8, 4, 2, 16, torch.uint8, "cpu")
    fp32 = KVCachePool(2, 8, 4, 2, 16, torch.float32, "cpu")
    assert int8.data.shape[-1] == fp8.data.shape[-1] == 20
    for a, b in ((int8, fp32), (fp32, int8), (int8, fp8), (fp8, int8)):
        with pytest.raises(ValueError, match="kv-cache-dtype"):
            a.write_blocks([0], b.read_blocks([1]))


def test_the_native_fp8_writer_rounds_every_tie_as_torch_does(be):
    """Rows scaled by exactly 1 (their first value 448): each halfway point between two
    e4m3 values, the floats just below and above it, and their negatives."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    half = (values[:-1] + values[1:]) / 2
    probes = torch.cat([half, torch.nextafter(half, half * 0), torch.nextafter(half, half * 2)])
    probes = torch.cat([probes, -probes, torch.tensor([448.0, -448.0])])
    width = 63
    probes = torch.cat([probes, torch.zeros(-len(probes) % width)]).reshape(-1, width)
    x = torch.cat([torch.full((len(probes), 1), 448.0), probes], dim=1).contiguous()
    got = torch.empty(len(x), 68, dtype=torch.uint8)
    be.lib.epd_kv_quantize(_ptr(got), _ptr(x), len(x), 64, 1)
    want = kv_quant.quantize(x, "fp8")
    assert torch.equal(want[:, 64:].view(torch.float32), torch.ones(len(x), 1))
    assert torch.equal(got, want)
