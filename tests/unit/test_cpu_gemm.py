"""The cpu backend's GEMM past the GEMV's rows (``services/kernels/cpu_gemm.py``).

oneDNN's products over packed copies of the weights must give the bits of its products over
the column-major weights the models keep, at every row count the backend sends it; the
copies must respect their memory budget, follow a weight written in place, and go with
their weight.
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from services.kernels import cpu_gemm
from services.kernels.cpu_gemm import OneDnnGemm

pytestmark = pytest.mark.skipif(
    not cpu_gemm.packing_works(), reason="oneDNN's packed linear is not in this torch"
)


def _column_major(n: int, k: int, seed: int) -> torch.Tensor:
    """W [n, k] stored as W^T, as the models keep linear weights on CPU."""
    return torch.randn(k, n, generator=torch.Generator().manual_seed(seed)).t()


def _plain(x, w, b=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@pytest.mark.parametrize("rows", [8, 9, 33, 64, 89, 257, 2048])
@pytest.mark.parametrize("n,k", [(1024, 512), (2816, 512), (512, 1408), (100, 72)])
def test_packed_products_are_the_plain_ones_bit_for_bit(rows, n, k):
    w, gen = _column_major(n, k, seed=n + k), torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    gemm = OneDnnGemm(budget_mb=64)
    for b in (None, bias):
        got = gemm(x, w, b)
        assert gemm.packed_bytes == w.numel() * 4
        assert torch.equal(got, _plain(x, w, b))
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-3, rtol=1e-4)  # sums of ~40


@pytest.mark.parametrize("threads", [1, 2])
def test_the_same_bits_on_two_threads(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x = _column_major(768, 256, seed=1), torch.randn(96, 256)
        assert torch.equal(OneDnnGemm(16)(x, w, None), _plain(x, w))
    finally:
        torch.set_num_threads(old)


def test_weights_past_the_budget_are_multiplied_as_they_are():
    ws = [_column_major(256, 256, seed=i) for i in range(5)]  # 256 KiB each
    gemm = OneDnnGemm(budget_mb=1)
    x = torch.randn(40, 256)
    for w in ws:
        assert torch.equal(gemm(x, w, None), _plain(x, w))
    assert gemm.packed_bytes == 4 * 256 * 256 * 4  # four fit in 1 MiB, the fifth does not
    assert [gemm._packs[id(w)][2] is None for w in ws] == [False] * 4 + [True]
    assert OneDnnGemm(budget_mb=0)(x, ws[0], None).equal(_plain(x, ws[0]))


def test_a_weight_written_in_place_is_packed_again():
    w, x = _column_major(128, 64, seed=3), torch.randn(16, 64)
    gemm = OneDnnGemm(budget_mb=1)
    before = gemm(x, w, None)
    with torch.no_grad():
        w.mul_(2)
    after = gemm(x, w, None)
    assert torch.equal(after, _plain(x, w)) and not torch.equal(after, before)
    assert gemm.packed_bytes == w.numel() * 4


def test_a_freed_weight_takes_its_copy_with_it():
    gemm = OneDnnGemm(budget_mb=1)
    w = _column_major(256, 256, seed=4)
    gemm(torch.randn(16, 256), w, None)
    assert gemm.packed_bytes > 0
    del w
    gc.collect()
    assert gemm.packed_bytes == 0 and not gemm._packs


def test_the_backend_multiplies_past_the_gemv_rows_on_packed_weights(be):
    if be.onednn is None:
        pytest.skip("MKL serves GEMMs on this CPU (Intel)")
    w, x = _column_major(1024, 512, seed=5), torch.randn(48, 512)
    got = be.linear(x, w)
    assert id(w) in be.onednn._packs and torch.equal(got, _plain(x, w))
