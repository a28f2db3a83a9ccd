"""The bfloat16 screen of the LM head gives the argmax of the exact logits: its bound holds
on every logit, its tokens equal float64's argmax (first index on ties), and rows it cannot
settle (too many candidates, non-finite hidden states) go to the fp32 head."""

from __future__ import annotations

import pytest
import torch

from services.kernels import cpu_head
from services.kernels.cpu_backend import CpuBackend

pytestmark = pytest.mark.skipif(
    not cpu_head.bf16_linear_works(), reason="oneDNN has no bfloat16 here"
)


@pytest.fixture(scope="module")
def be(tmp_path_factory) -> CpuBackend:
    backend = CpuBackend.create(str(tmp_path_factory.mktemp("kernels")), greedy_head_screen="on")
    assert backend is not None and backend.screen_heads
    return backend


def _head(vocab: int, k: int, layout: str, seed: int, scale: float = 0.05) -> torch.Tensor:
    w = torch.randn(vocab, k, generator=torch.Generator().manual_seed(seed)) * scale
    return w.t().contiguous().t() if layout == "column-major" else w


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).argmax(dim=-1)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
@pytest.mark.parametrize("rows", [1, cpu_head.NATIVE_ROWS, 40])  # the native product, oneDNN's
def test_the_bound_holds_on_every_logit(be, threads, scale, rows):
    w = _head(5003, 99, "column-major", 1)
    screen = cpu_head.ScreenedHead(be.lib, w, 1, be._split)
    x = torch.randn(rows, 99, generator=torch.Generator().manual_seed(2)) * scale
    xb = x.to(torch.bfloat16)
    s = screen.approximate(xb).double()
    xbd = xb.double()
    p, q = xbd.norm(dim=1), (xbd - x.double()).norm(dim=1) + screen.sums * xbd.norm(dim=1)
    width = (
        p[:, None] * screen.err_norms.double() + q[:, None] * screen.norms.double() + s.abs() / 255
    )
    assert ((s - x.double() @ w.double().t()).abs() <= width).all()


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
def test_tokens_are_the_exact_logits_argmax(be, threads, rows, layout):
    w = _head(8000, 128, layout, rows)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(100 + rows)) * 2
    assert torch.equal(be.greedy_head(x, w), _exact(x, w))


def test_ties_and_near_ties_go_to_the_first_index(be):
    w = _head(4000, 64, "column-major", 3).t().contiguous()  # W^T, edited below as W
    wv = w.t()
    wv[2500] = wv[10]  # an exact tie: index 10 wins
    wv[3000] = wv[20] * (1 + 2**-12)  # 20's logit just below 3000's, far closer than bf16 tells
    x = torch.stack([wv[10] * 30, wv[20] * 30, -wv[20] * 30])
    got = be.greedy_head(x, wv)
    assert got.tolist()[:2] == [10, 3000]
    assert torch.equal(got, _exact(x, wv))


def test_rows_it_cannot_settle_go_to_the_fp32_head(be):
    w = torch.ones(cpu_head.CAP + 50, 32) / 8  # every logit equal: all are candidates
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    x[1] = float("nan")
    x[2, 3] = float("inf")
    x[3] = 3e38  # finite, but its logits overflow to inf
    want = be._fp32_greedy(x, w)
    assert torch.equal(be.greedy_head(x, w), want)
    assert want[0] == 0  # the first of the tied entries


def test_a_screen_is_made_once_per_head_and_off_means_off(be, tmp_path):
    w = _head(3000, 64, "column-major", 7)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    be.greedy_head(x, w)
    first = be._screen(w)
    be.greedy_head(x, w)
    assert be._screen(w) is first
    w[0] = 0.0  # written in place (a reload): the next step screens the new head
    assert be._screen(w) is not first
    assert torch.equal(be.greedy_head(x, w), _exact(x, w))
    off = CpuBackend.create(str(tmp_path), greedy_head_screen="off")
    assert not off.screen_heads
    assert torch.equal(off.greedy_head(x, w), be.greedy_head(x, w))
    assert not off._screens


def test_the_kernel_leaves_rows_with_too_many_candidates(be):
    w = torch.ones(300, 16)
    screen = cpu_head.ScreenedHead(be.lib, w, 0, be._split)
    for rows in (1, 3):
        assert screen(torch.ones(rows, 16)).tolist() == [-1] * rows


def test_the_native_product_is_onednns(be):
    """One or two rows take epd_gemv_bf16, more oneDNN: the same bfloat16 logits but for
    the order of the fp32 sums (a bfloat16 ulp at most)."""
    w = _head(3000, 200, "column-major", 11)
    screen = cpu_head.ScreenedHead(be.lib, w, 1, be._split)
    x = torch.randn(cpu_head.NATIVE_ROWS, 200, generator=torch.Generator().manual_seed(12))
    xb = x.to(torch.bfloat16)
    native = screen.approximate(xb).float()
    onednn = torch.ops.mkldnn._linear_pointwise(xb, screen.packed, None, "none", [], "").float()
    assert ((native - onednn).abs() <= onednn.abs() / 64 + 1e-6).all()
