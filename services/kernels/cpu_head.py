"""Greedy tokens from the LM head through a bfloat16 screen, the same tokens as fp32.

A greedy step needs only the argmax of each row's logits, yet the head is the largest
product of a decode step (the peers Llama's [32000, 512] head: ~25 % of a 64-row step on
an AVX-512 core). Where the CPU multiplies bfloat16 in hardware (AMX tiles, AVX512_BF16)
oneDNN computes a bfloat16 copy of it in about half the time, and half the bytes at one
row. Those logits are not the fp32 ones, so they only screen: each lies within a bound of
its exact value, and a vocabulary entry whose upper bound stays below the row's best
lower bound cannot be the argmax. The few that can (2-10 a row on a random head) get exact
fp32 dot products in ``csrc/epd_head.c``, and the largest wins, the first index on ties.
The token is therefore the argmax of fp32 logits; only the order of the sums differs from
the fp32 GEMM's (as it differs between any two GEMMs), which can decide between two
logits equal to ~1e-7.

The bound, for s = bf16(x^ . W^_v) with fp32 sums, x^ = bf16(x), W^ = bf16(W), z = x . W_v:
x^.W^ - x.W = x^.(W^ - W) + (x^ - x).W, so by Cauchy-Schwarz on each term
    |s - z| <= ||x^|| ||W^_v - W_v|| + ||x^ - x|| ||W_v|| + sums + eps_out |s|,
the sums' share (2K fp32 roundings of at most 2^-24, with a margin) bounded by a multiple
of ||x^|| ||W_v||, eps_out the output's rounding. Row norms come per step, the head's two
per vocabulary entry once. The rounding errors' own norms are ~0.3 of their worst case,
which keeps the bound ~3x tighter than 2^-7 ||x|| ||W_v||. A row with more than ``cap``
candidates, or anything non-finite, is left to the fp32 path.

Memory: two bfloat16 copies (oneDNN's packed one, and a plain W^T for one or two rows):
together the fp32 head's size again, made on the head's first greedy step, with two
floats per vocabulary entry.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from services.kernels import cpu_native

U_BF16 = 2.0**-8
U_FP32 = 2.0**-24
# oneDNN's weight packing is tuned for a batch size; the screen runs from 1 to ~256 rows.
PACK_ROWS = 64
# Up to this many rows the bfloat16 logits come from epd_gemv_bf16 (a plain W^T copy
# streamed as the fp32 GEMV streams it), beyond from oneDNN's packed copy. The peers
# Llama's head, the caches flushed before each call, one core: 1 row 1.9-2.0 ms against
# oneDNN's 3.3-3.5 (fp32: 3.2), 2 rows 2.3 against 3.1-3.4, 4 rows 3.4 against 2.9-3.1.
NATIVE_ROWS = 2
CAP = 256  # candidates a row may have before it goes to the fp32 path


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AMX tiles, or AVX512_BF16's as on AMD's Zen 4),
    and a torch whose oneDNN linear takes packed bfloat16 weights. Without them oneDNN
    widens every bfloat16 to float32 first, and fp32 is faster."""
    try:
        native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
        return bool(native) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def bf16_linear_works() -> bool:
    """Whether oneDNN multiplies packed bfloat16 weights here at all (``on`` asks for the
    screen even where bfloat16 is emulated; where it is not there, the fp32 head serves)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 4, dtype=torch.bfloat16), 8)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(8, 4, dtype=torch.bfloat16), w, None, "none", [], ""
        )
        return bool((y.float() == 4).all())
    except (RuntimeError, AttributeError):
        return False


def sums_share(k: int) -> float:
    """The fp32 sums' error over a k-term dot product, as a multiple of ||x^|| ||W_v||
    (W^'s norm is at most (1 + 2^-8) times W's; a 2x margin on the count of roundings)."""
    g = 2 * k * U_FP32
    return g / (1 - g) * (1 + U_BF16) * 1.01


def _up(t: torch.Tensor) -> torch.Tensor:
    """float64 norms rounded up to float32 (never below the exact value)."""
    return (t * (1 + 1e-6)).float()


def head_norms(w: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(||W_v||, ||bf16(W_v) - W_v||) per row of ``w`` [n, k], in float64, rounded up."""
    wn, dwn = torch.empty(w.shape[0]), torch.empty(w.shape[0])
    for lo in range(0, w.shape[0], chunk):
        part = w[lo : lo + chunk].double()
        wn[lo : lo + chunk] = _up(part.norm(dim=1))
        dwn[lo : lo + chunk] = _up((part - part.to(torch.bfloat16).double()).norm(dim=1))
    return wn, dwn


class ScreenedHead:
    """The screen for one fp32 head ``weight`` [V, K] (W^T or row-major, as the GEMVs
    read it); ``__call__(x)`` gives the greedy tokens of ``x`` [M, K] fp32. ``split(n,
    min_chunk)``: the backend's ranges per thread."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        weight: torch.Tensor,
        layout: int,
        split: Callable[[int, int], list[tuple[int, int]]],
    ):
        self.lib, self.weight, self.layout, self.split = lib, weight, layout, split
        self.version = weight._version  # torch's count of in-place writes: stale when it moves
        self.vocab, self.k = weight.shape
        self.plain = weight.t().contiguous().to(torch.bfloat16)  # W^T [K, V]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            self.plain.t().contiguous(), PACK_ROWS
        )
        self.norms, self.err_norms = head_norms(weight)
        self.sums = sums_share(self.k)

    def approximate(self, xb: torch.Tensor) -> torch.Tensor:
        """[M, V] bfloat16 logits of ``xb`` [M, K] bfloat16, the sums in fp32."""
        if xb.shape[0] > NATIVE_ROWS:
            return torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        s = torch.empty(xb.shape[0], self.vocab, dtype=torch.bfloat16)
        ptr = cpu_native.ptr
        if self.lib.epd_par_gemv_bf16(
            ptr(s),
            ptr(xb),
            ptr(self.plain),
            xb.shape[0],
            self.k,
            self.vocab,
            *cpu_native.bounds(self.split(self.vocab, 2048)),
        ):
            raise MemoryError("greedy head: out of memory for the bfloat16 sums")
        return s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[M] int64 tokens; -1 where the row is left to the fp32 path."""
        xb = x.to(torch.bfloat16)
        xd, xbd = x.double(), xb.double()
        xbn = xbd.norm(dim=1)
        out = torch.full((x.shape[0],), -1, dtype=torch.int64)
        if not bool(torch.isfinite(xbn).all()):
            return out
        s = self.approximate(xb)
        # + 1e-30: what flushing subnormal inputs to zero may add (at most K * 2^-126 each).
        p, q = _up(xbn) + 1e-30, _up((xbd - xd).norm(dim=1) + self.sums * xbn) + 1e-30
        ptr = cpu_native.ptr
        left = self.lib.epd_par_screen_argmax(
            ptr(out),
            ptr(s),
            ptr(x),
            ptr(self.weight),
            ptr(self.norms),
            ptr(self.err_norms),
            ptr(p),
            ptr(q),
            self.k,
            self.vocab,
            self.layout,
            CAP,
            *cpu_native.bounds(self.split(x.shape[0], 8)),
        )
        if left < 0:
            raise MemoryError("greedy head: out of memory for the screen's scratch")
        return out
