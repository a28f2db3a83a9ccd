"""The multi-row GEMV (``csrc/epd_gemv_rows.c``): batch invariance, bitwise.

A request's tokens must not depend on its batch, so row r of an m-row GEMV must be
bitwise the GEMV of that row alone (the one-row streaming loop of ``epd_gemv_t``), for
every m, on shapes that reach each of its paths: k not a multiple of 8 (tail rows), n not
a multiple of 8 (tail columns), a column slice of a wider y (a thread's share), a bias,
more rows than one pass takes (32) and more columns than one accumulator tile holds.
"""

import pytest
import torch
import torch.nn.functional as F

from services.kernels.cpu_native import ptr

# (k, n): odd sizes; 4500 columns at 16 rows cross a column tile (4096 at 16 rows)
SHAPES = [(77, 37), (13, 1001), (70, 3000), (21, 4500)]


def _gemv_t(lib, x, wt, bias, y, col0: int, cols: int) -> None:
    """Columns col0..col0 + cols of y = x @ wt (+ bias): one epd_gemv_t call, as a thread
    of the backend's layer path makes it (y and wt keep their full row strides)."""
    m, k = x.shape
    n = wt.shape[1]
    lib.epd_gemv_t(ptr(y, col0), n, ptr(x), ptr(wt, col0), n, ptr(bias, col0), m, k, cols)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_is_summed_as_if_alone(be, k, n, bias):
    gen = torch.Generator().manual_seed(k * n)
    wt = torch.randn(k, n, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(33, k, generator=gen)
    alone = torch.empty(33, n)
    for r in range(33):
        _gemv_t(be.lib, x[r : r + 1], wt, b, alone[r : r + 1], 0, n)
    torch.testing.assert_close(alone, F.linear(x, wt.t(), b), atol=1e-4, rtol=1e-4)
    for m in range(1, 34):
        y = torch.full((m, n), float("nan"))
        _gemv_t(be.lib, x[:m], wt, b, y, 0, n)
        assert torch.equal(y, alone[:m]), f"{m} rows differ from the rows alone"
        # the multi-row kernel itself, also where epd_gemv_t keeps its one-row loop
        y = torch.full((m, n), float("nan"))
        assert be.lib.epd_gemv_rows(ptr(y), n, ptr(x), ptr(wt), n, ptr(b), m, k, n) == 0
        assert torch.equal(y, alone[:m]), f"epd_gemv_rows: {m} rows differ"


@pytest.mark.parametrize("m", [2, 5, 16])
def test_a_column_slice_leaves_the_rest_of_y(be, m):
    """A thread's share: columns 40..40+523 of a 1001-wide y, the rest untouched."""
    gen = torch.Generator().manual_seed(m)
    k, n, c0, cols = 51, 1001, 40, 523
    wt, x, b = torch.randn(k, n, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n)
    y = torch.full((m, n), 7.0)
    _gemv_t(be.lib, x, wt, b, y, c0, cols)
    alone = torch.full((m, n), 7.0)
    for r in range(m):
        _gemv_t(be.lib, x[r : r + 1], wt, b, alone[r : r + 1], c0, cols)
    assert torch.equal(y, alone)
    assert torch.equal(y[:, :c0], torch.full((m, c0), 7.0))
    assert torch.equal(y[:, c0 + cols :], torch.full((m, n - c0 - cols), 7.0))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_layer_path_is_batch_invariant(be, threads):
    """be.linear on W^T up to GEMV_MAX_ROWS (32) rows, split over threads by columns."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        w = torch.randn(4500, 70, generator=gen).t().contiguous().t()  # W^T contiguous
        x = torch.randn(32, 70, generator=gen)
        alone = torch.cat([be.linear(x[r : r + 1], w) for r in range(32)])
        for m in (2, 3, 8, 17, 32):
            assert torch.equal(be.linear(x[:m], w), alone[:m])
    finally:
        torch.set_num_threads(old)
