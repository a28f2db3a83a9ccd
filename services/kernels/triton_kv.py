"""KV cache write: scatter the step's new K/V rows into their paged cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import FLOAT_DTYPES, check, check_kv_cache, check_tensor


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program t: copy token t's [Hkv, D] key and value rows to slot ``slot_mapping[t]``."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token: nothing to write
        return
    block, offset = slot // PAGE, slot % PAGE
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
    dst = block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + src, mask=mask)
    dst = block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative: skip the row
) -> None:
    """Scatter K/V rows into the caches (cast to the cache dtype); rows may be strided views."""
    dev = key.device
    check_tensor(key, "key", 3, FLOAT_DTYPES, dev)
    check_tensor(value, "value", 3, FLOAT_DTYPES, dev)
    check_kv_cache(k_cache, v_cache, dev)
    check_tensor(slot_mapping, "slot_mapping", 1, (torch.int64,), dev)
    check(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    check(key.shape[1:] == k_cache.shape[2:], "key [T, Hkv, D] does not match the cache's [Hkv, D]")
    check(slot_mapping.shape[0] == key.shape[0], "slot_mapping must have one slot per row")
    t, h, d = key.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_HEADS=h,
        HEAD_DIM=d,
        PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d),
    )
