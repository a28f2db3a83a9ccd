"""The int8 KV cache (``--kv-cache-dtype int8``, docs/quantization.md).

Each token's K (or V) vector of one KV head is stored as its ``D`` int8 codes followed by
the four bytes of its fp32 scale: a cache of this kind is an int8 tensor
``[num_blocks, block_size, Hkv, D + 4]``. The scale being part of the row, everything that
moves blocks (prefix sharing, preemption, migration, the fleet's prefill-to-decode
hand-off) moves the scales with them unchanged, and a cache is still one tensor per K and V.

A scale per token and head (amax / 127, rounded to nearest even codes) never changes once
written, so a block is never re-quantized when later tokens arrive, and a row's values do
not depend on what else the step holds: the batch-invariance rule holds for the KV too.
The native kernels (csrc/epd_kvq8.c) quantize with the same operations in the same order.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def is_quantized(*caches: torch.Tensor) -> bool:
    """Whether every one of ``caches`` is an int8 cache."""
    return all(c.dtype == torch.int8 for c in caches)


def row_width(head_dim: int) -> int:
    """Bytes of one token's vector of one head in an int8 cache."""
    if head_dim % 4:
        raise ValueError(f"an int8 KV cache needs a head size divisible by 4, not {head_dim}")
    return head_dim + SCALE_BYTES


def head_dim(cache: torch.Tensor) -> int:
    """The head size a cache holds, of either kind."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] int8 rows: codes round(x / s), s = amax / 127 (0 for
    an all-zero vector, whose codes are then 0)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale)))
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    out[..., : x.shape[-1]] = codes.clamp_(-127, 127).to(torch.int8)
    out[..., x.shape[-1] :] = scale.view(torch.int8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize`` up to rounding: [..., D + 4] int8 -> [..., D] ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def readable(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache of either kind, as values of ``dtype``."""
    if is_quantized(cache_rows):
        return dequantize(cache_rows, dtype)
    return cache_rows.to(dtype)
