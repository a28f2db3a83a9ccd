"""The fp32 GEMM of the cpu backend's linears past the native GEMV's rows.

Which library: oneDNN's on AMD CPUs, where MKL skips its AVX-512 path (oneDNN was 5-25 %
faster on a decode step's shapes), MKL's (torch's own) on Intel, where it is 5-25 % faster
than oneDNN on unpacked weights (64-2048 rows, the peers Llama's matrices and LM head).
Chosen by vendor, never by a timing at start-up, so a given machine always sums the same
way.

What oneDNN reads: models keep every linear weight column-major (W^T contiguous), the
layout the native GEMV streams. oneDNN's kernels read weights in a blocked layout of their
own, and given a plain one they re-block it on every call: the whole model's weights
copied once per step. ``OneDnnGemm`` keeps a blocked copy of each weight instead, made on
its first GEMM while a memory budget lasts (``EngineConfig.packed_weights_mb``). The
copies give the same bits (the same kernel runs either way; ``tests/unit/test_cpu_gemm.py``
checks 8 to 2,048 rows) and are kept beside the column-major weights, which the GEMV and
the one-call decode step still read. On the peers Llama, one AMD Zen 4 core: 64-row
products 5-30 % faster, 2,048-row ones 2-12 % (``bench/packed_gemm.py``;
docs/cpu-performance.md, "Packed oneDNN weights").
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

GEMM_MIN_ROWS = 8
# oneDNN tunes a blocked layout for a batch size; one packed for 64 rows served 33-2,048
# rows about as fast as one packed for 2,048 (either ahead by up to ~15 % on some shapes,
# bench/packed_gemm.py), with the same bits.
PACK_ROWS = 64


@functools.cache
def prefer_mkldnn() -> bool:
    """oneDNN's GEMM for linears past the GEMV's rows (AMD and other non-Intel CPUs, where
    it works), or torch's own (MKL on Intel)?"""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return _mkldnn_linear_works()
    return "GenuineIntel" not in info and _mkldnn_linear_works()


def _mkldnn_linear_works() -> bool:
    try:
        x, w = torch.ones(GEMM_MIN_ROWS, 4), torch.ones(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return bool(torch.equal(y, F.linear(x, w)))
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def packing_works() -> bool:
    """Whether oneDNN here takes a weight it packed (torch's private op, pinned with torch
    2.13.0) and gives the plain weight's product."""
    try:
        x, w = torch.randn(GEMM_MIN_ROWS + 1, 24), torch.randn(40, 24)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        want = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.equal(
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), want
        )
    except (RuntimeError, AttributeError):
        return False


class OneDnnGemm:
    """``y = x @ W^T + b`` through oneDNN, on a packed copy of W while the budget lasts.

    A copy is made on a weight's first call (the calls of a model's first steps, so the
    same weights are packed every run) and made again after the weight is written in
    place; a weight past the budget is multiplied as it is.
    """

    def __init__(self, budget_mb: int):
        self.budget = budget_mb << 20 if packing_works() else 0
        self._packs: dict[int, tuple[weakref.ref, int, torch.Tensor | None]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        return torch.ops.mkldnn._linear_pointwise(x, self._weight(weight), bias, "none", [], "")

    @property
    def packed_bytes(self) -> int:
        """Memory held by the packed copies."""
        return sum(
            w.numel() * w.element_size() for _, _, w in self._packs.values() if w is not None
        )

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        held = self._packs.get(key)
        if held is not None and held[0]() is weight and held[1] == _version(weight):
            return weight if held[2] is None else held[2]
        if held is not None:
            del self._packs[key]  # a write in place, or a new weight where a freed one was
        size = weight.numel() * weight.element_size()
        packed = None
        if self.packed_bytes + size <= self.budget:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
        ref = weakref.ref(weight, lambda r, k=key: self._forget(k, r))
        self._packs[key] = (ref, _version(weight), packed)
        return weight if packed is None else packed

    def _forget(self, key: int, ref: weakref.ref) -> None:
        held = self._packs.get(key)
        if held is not None and held[0] is ref:
            del self._packs[key]


def _version(t: torch.Tensor) -> int:
    """t's count of in-place writes; an inference tensor (made under torch.inference_mode)
    keeps none, and counts as never written."""
    return 0 if t.is_inference() else t._version
