"""The quantized KV caches (``--kv-cache-dtype int8 | fp8``, docs/quantization.md).

Each token's K (or V) vector of one KV head is stored as its ``D`` one-byte codes followed
by the four bytes of its fp32 scale: a cache of this kind is a one-byte tensor
``[num_blocks, block_size, Hkv, D + 4]``, ``int8`` for int8 codes and ``uint8`` for fp8
(e4m3, the bytes of ``torch.float8_e4m3fn``). The scale being part of the row, everything
that moves blocks (prefix sharing, preemption, migration, the fleet's prefill-to-decode
hand-off) moves the scales with them unchanged, and a cache is still one tensor per K and V.

A scale per token and head (amax / 127 for int8, amax / 448 for fp8: the largest code)
never changes once written, so a block is never re-quantized when later tokens arrive, and
a row's values do not depend on what else the step holds: the batch-invariance rule holds
for the KV too. Codes round to nearest even (fp8: saturating at 448, as torch's
conversion does). The native kernels (csrc/epd_kvq8.c) quantize with the same operations
in the same order and store the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
# --kv-cache-dtype -> (the cache tensor's dtype, the largest code)
FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.uint8, 448.0)}
_BY_DTYPE = {dtype: (name, top) for name, (dtype, top) in FORMATS.items()}


def quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds quantized rows."""
    return dtype in _BY_DTYPE


def is_quantized(*caches: torch.Tensor) -> bool:
    """Whether every one of ``caches`` is a quantized cache (of one format)."""
    return len({c.dtype for c in caches}) == 1 and quantized_dtype(caches[0].dtype)


def format_of(cache: torch.Tensor) -> str:
    """``int8`` or ``fp8``: the format of a quantized cache."""
    return _BY_DTYPE[cache.dtype][0]


def row_width(head_dim: int) -> int:
    """Bytes of one token's vector of one head in a quantized cache."""
    if head_dim % 4:
        raise ValueError(f"a quantized KV cache needs a head size divisible by 4, not {head_dim}")
    return head_dim + SCALE_BYTES


def head_dim(cache: torch.Tensor) -> int:
    """The head size a cache holds, of any kind."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize(x: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] rows of ``fmt``: codes of x / s, s = amax / top
    (0 for an all-zero vector, whose codes are then 0)."""
    dtype, top = FORMATS[fmt]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / top
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if fmt == "int8":
        codes = torch.round(y).clamp_(-top, top).to(torch.int8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    out[..., : x.shape[-1]] = codes
    out[..., x.shape[-1] :] = scale.view(dtype)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize`` up to rounding: [..., D + 4] rows -> [..., D] ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].view(torch.float32)
    codes = rows[..., :d]
    if format_of(rows) == "fp8":
        codes = codes.view(torch.float8_e4m3fn)
    return (codes.float() * scale).to(dtype)


def readable(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache of any kind, as values of ``dtype``."""
    if is_quantized(cache_rows):
        return dequantize(cache_rows, dtype)
    return cache_rows.to(dtype)
