"""Rotary position embedding, in place, neox (halves) and GPT-J (interleaved) layouts.

Rope scaling (linear, dynamic NTK, YaRN, llama3 ...) lives entirely in ``cos_sin_cache``,
which the model builds from its config: the kernel only looks up row ``positions[t]``.
The rotation is done in fp32 and rounded once to the tensor's dtype, like the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import FLOAT_DTYPES, check, check_tensor


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    cos,
    sin,
    offs_j,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotate the pairs (x1, x2) of every head of one token: x1' = x1 c - x2 s, x2' = x2 c + x1 s."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_j < HALF)[None, :]
    if IS_NEOX:
        i1, i2 = offs_j, offs_j + HALF
    else:
        i1, i2 = 2 * offs_j, 2 * offs_j + 1
    p1 = x_ptr + offs_h[:, None] * stride_h + i1[None, :]
    p2 = x_ptr + offs_h[:, None] * stride_h + i2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Program t: every query and key head of token t."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_j, mask=j_mask, other=1.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_j, mask=j_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_j, HQ, HALF, BLOCK_HQ, IS_NEOX)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_j, HKV, HALF, BLOCK_HKV, IS_NEOX)


def rotary(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D], may be a strided view (e.g. of a fused qkv)
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] fp32: cos first half, sin second
    is_neox: bool,
) -> None:
    """Rotate the first rot_dim features of every head of query and key in place."""
    dev = query.device
    check_tensor(positions, "positions", 1, (torch.int64,), dev)
    check_tensor(query, "query", 3, FLOAT_DTYPES, dev)
    check_tensor(key, "key", 3, FLOAT_DTYPES, dev)
    check_tensor(cos_sin_cache, "cos_sin_cache", 2, (torch.float32,), dev)
    t, rot = query.shape[0], cos_sin_cache.shape[1]
    check(key.shape[0] == t and positions.shape[0] == t, "positions, query and key disagree on T")
    check(rot % 2 == 0 and rot <= min(query.shape[2], key.shape[2]), f"bad rot_dim {rot}")
    if t == 0:
        return
    _rotary_kernel[(t,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        HQ=query.shape[1],
        HKV=key.shape[1],
        HALF=rot // 2,
        BLOCK_J=triton.next_power_of_2(rot // 2),
        BLOCK_HQ=triton.next_power_of_2(query.shape[1]),
        BLOCK_HKV=triton.next_power_of_2(key.shape[1]),
        IS_NEOX=is_neox,
    )
