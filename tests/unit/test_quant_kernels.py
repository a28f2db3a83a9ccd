"""Quantized weights (services/kernels/quant.py) and their native kernels
(csrc/epd_quant.c) against the float64 reference of the same arithmetic.

Shapes reach every block of the kernels: 1 row (several panels at once), 2-7 rows (the
tail blocks), 13 and 33 rows (full blocks and a tail); a last panel of 1-15 columns; int4
groups of 32, 64 and 128 and per-channel; one and two threads. A row's result must not
depend on its batch (bitwise), as the fp32 GEMVs promise.
"""

import pytest
import torch
import torch.nn.functional as F

from services.kernels import torch_backend as ref
from services.kernels.backend import get_backend
from services.kernels.quant import (
    QuantizedWeight,
    int4_weight,
    int8_weight,
    quantize,
    reference_linear,
)
from services.models.quantize import QuantLinear
from tests.helpers.threads import set_threads

ROWS = (1, 2, 3, 4, 5, 6, 7, 13, 33)
SHAPES = [(7, 32), (40, 64), (300, 256), (97, 384)]  # (n, k): partial last panels


@pytest.fixture(scope="module")
def cpu():
    be = get_backend("auto", torch.device("cpu"))
    if be.name != "cpu":
        pytest.skip("native kernels unavailable (no C compiler)")
    return be


threads = pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])(set_threads)


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0))
    q = quantize(w, "int8")
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert q.codes.dtype == torch.int8 and q.codes.shape == (3, 50, 16)
    assert q.nbytes == 48 * 50 + 48 * 4  # codes and scales, 37 columns padded to 48


def test_int4_round_trip_within_half_a_step():
    w = torch.randn(20, 256, generator=torch.Generator().manual_seed(1))
    q = quantize(w, "int4")
    assert q.group == 128 and q.codes.shape == (2, 256, 8)
    g = w.reshape(20, 2, 128)
    step = (g.amax(dim=2).clamp(min=0) - g.amin(dim=2).clamp(max=0)) / 15
    err = (q.dequantize() - w).abs().reshape(20, 2, 128)
    assert (err <= step[..., None] / 2 + 1e-6).all()


def test_int4_from_codes_is_codes_minus_zero_times_scale():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (18, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(18, 2, generator=gen) + 0.1
    zero = torch.randint(0, 16, (18, 2), generator=gen).float()
    want = (codes.float() - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    torch.testing.assert_close(int4_weight(codes, scale, zero).dequantize(), want)
    with pytest.raises(ValueError, match="outside 0-15"):
        int4_weight(codes.to(torch.int16) + 16, scale, zero)
    with pytest.raises(ValueError, match="do not fit"):
        int4_weight(codes, scale[:, :1].expand(18, 3).contiguous(), zero[:, :1].expand(18, 3))


def test_int8_from_codes():
    codes = torch.tensor([[1, -2, 127], [-127, 0, 5]], dtype=torch.int8)
    q = int8_weight(codes, torch.tensor([0.5, 2.0]))
    assert torch.equal(q.dequantize(), torch.tensor([[0.5, -1.0, 63.5], [-254.0, 0.0, 10.0]]))


def _bound(x, q: QuantizedWeight) -> float:
    """fp32 rounding of sums of k products (and of int4's group terms), generously."""
    w = q.dequantize().abs()
    return float((x.abs() @ w.t()).max()) * q.shape[1] * 2e-7 + 1e-5


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_reference_and_is_batch_invariant(cpu, threads, method, n, k):
    gen = torch.Generator().manual_seed(n * k)
    q = quantize(torch.randn(n, k, generator=gen), method)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k, generator=gen)
    alone = torch.cat([cpu.linear(x[i : i + 1], q, bias) for i in range(len(x))])
    for m in ROWS:
        y = cpu.linear(x[:m], q, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        want = reference_linear(x[:m], q, bias)
        assert float((y - want).abs().max()) <= _bound(x[:m], q)
        assert torch.equal(y, alone[:m]), f"{m} rows: a row's result depends on its batch"
    no_bias = cpu.linear(x[:5], q)  # the same sums, the bias not added
    torch.testing.assert_close(no_bias, alone[:5] - bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_smaller_groups(cpu, group):
    gen = torch.Generator().manual_seed(group)
    n, k = 33, 192
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.1
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    q = int4_weight(codes, scale, zero)
    assert q.group == group
    x = torch.randn(9, k, generator=gen)
    assert float((cpu.linear(x, q) - reference_linear(x, q)).abs().max()) <= _bound(x, q)


def test_per_channel_int4_when_no_group_divides(cpu):
    q = quantize(torch.randn(16, 40), "int4")
    assert q.group == 40
    x = torch.randn(3, 40)
    assert float((cpu.linear(x, q) - reference_linear(x, q)).abs().max()) <= _bound(x, q)


def test_inputs_the_kernel_does_not_take_fall_back_to_torch(cpu):
    q = quantize(torch.randn(24, 64), "int8")
    x = torch.randn(64, 4).t()  # not contiguous
    torch.testing.assert_close(cpu.linear(x, q), F.linear(x, q.dequantize()))
    xd = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(cpu.linear(xd, q), F.linear(xd, q.dequantize(torch.float64)))
    assert cpu.linear(torch.empty(0, 64), q).shape == (0, 24)


def test_torch_backend_multiplies_the_dequantized_weight():
    q = quantize(torch.randn(24, 64), "int4")
    x, b = torch.randn(3, 64), torch.randn(24)
    assert torch.equal(ref.linear(x, q, b), F.linear(x, q.dequantize(), b))


def test_quant_linear_module():
    lin = torch.nn.Linear(64, 24)
    mod = QuantLinear(quantize(lin.weight, "int8"), lin.bias)
    x = torch.randn(5, 64)
    assert isinstance(mod.weight, QuantizedWeight) and mod.weight.shape == (24, 64)
    torch.testing.assert_close(mod(x), lin(x), atol=0.02, rtol=0.02)
    assert {n for n, _ in mod.named_buffers()} == {"codes", "scale"}
