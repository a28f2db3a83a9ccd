"""Paged decode attention: one query token per sequence, GQA, with a split-K variant.

Numerics as in ``triton_paged`` (fp32 scores in log2 units, online softmax).
Split-K (flash-decoding) programs each cover one token range and write an fp32 partial
output (already divided by its own softmax sum) plus its log2-sum-exp; an empty range
writes ``lse = -inf`` and weighs nothing in the reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import check, check_gqa, check_kv_cache, check_tensor, num_sms
from services.kernels.triton_paged import LOG2E, attend_paged

_BLOCK_N = 64  # keys per inner iteration
_MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to reduce than it saves
_MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    table_ptr,
    seq_lens_ptr,
    qk_scale,
    tokens_per_split,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    stride_os,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (seq b, kv head, split): the GROUP query heads of one kv head over a token range.

    The query heads sharing a kv head form the rows of one tile (padded to 16 for tl.dot),
    so each K/V tile is read once per kv head.
    """
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0
    )
    start = split * tokens_per_split
    end = tl.minimum(tl.load(seq_lens_ptr + b), start + tokens_per_split)
    acc, m, l_sum = attend_paged(
        q.to(k_ptr.dtype.element_ty),
        k_ptr,
        v_ptr,
        table_ptr + b * stride_tb,
        start,
        end,
        tl.full([BLOCK_G], end - 1, tl.int32),
        kvh,
        offs_d,
        offs_d < HEAD_DIM,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        BLOCK_G,
        BLOCK_D,
        BLOCK_N,
        PAGE,
        IEEE,
    )
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = (
        out_ptr + b * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    if SPLIT:
        # An empty split (l = 0) gets lse = -inf; else m + log2(l) is its log2-sum-exp.
        lse = tl.where(l_sum > 0, m + tl.log2(tl.maximum(l_sum, 1e-30)), float("-inf"))
        lse_ptrs = lse_ptr + (b * GROUP * tl.num_programs(1) + heads) * tl.num_programs(2) + split
        tl.store(lse_ptrs, lse, mask=offs_g < GROUP)


@triton.jit
def _reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq b, query head): merge the splits' partials weighted by 2^(lse - max lse)."""
    b, h = tl.program_id(0), tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask, d_mask = offs_s < num_splits, offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: every weight is 0
    w = tl.exp2(lse - m)
    parts = tl.load(
        part_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K only when (seq, kv head) programs cannot fill the GPU and contexts are long."""
    programs = batch * kv_heads
    sms = num_sms(device)
    if programs >= sms or max_seq_len < 2 * _MIN_TOKENS_PER_SPLIT:
        return 1
    by_length = triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sms, programs), by_length, _MAX_SPLITS))


def _check_decode(query, k_cache, v_cache, block_tables, seq_lens) -> int:
    dev = query.device
    check_tensor(query, "query", 3, (torch.float32, torch.float16, torch.bfloat16), dev)
    check_kv_cache(k_cache, v_cache, dev)
    group = check_gqa(query, k_cache)
    check_tensor(block_tables, "block_tables", 2, (torch.int32,), dev)
    check_tensor(seq_lens, "seq_lens", 1, (torch.int32,), dev)
    b = query.shape[0]
    check(
        block_tables.shape[0] == b and seq_lens.shape[0] == b, "one query row per sequence expected"
    )
    check(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    return group


def _split_workspace(out: torch.Tensor, num_splits: int):
    """Where the decode kernel writes: fp32 partials [B, Hq, S, D] + lse [B, Hq, S], or out."""
    b, hq, d = out.shape
    if num_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0)  # lse is never touched
    part = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=out.device)
    lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=out.device)
    return part, lse, (part.stride(0), part.stride(1), part.stride(2))


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]: one token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32; rows may be strided
    seq_lens: torch.Tensor,  # [B] int32, >= 1
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:  # [B, Hq, D], query's dtype
    """Paged decode attention; ``num_splits=None`` picks split-K for long contexts / small batches."""
    group = _check_decode(query, k_cache, v_cache, block_tables, seq_lens)
    b, hq, d = query.shape
    out = torch.empty_like(query)
    if b == 0:
        return out
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, max_seq_len, query.device)
    tokens = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), _BLOCK_N) * _BLOCK_N
    split = num_splits > 1
    target, lse, strides = _split_workspace(out, num_splits)
    _decode_kernel[(b, hkv, num_splits)](
        query,
        k_cache,
        v_cache,
        target,
        lse,
        block_tables,
        seq_lens,
        scale * LOG2E,
        tokens,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *strides,
        GROUP=group,
        HEAD_DIM=d,
        PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=_BLOCK_N,
        SPLIT=split,
        IEEE=k_cache.dtype == torch.float32,
        num_warps=4,
    )
    if split:
        _reduce_kernel[(b, hq)](
            target,
            lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(d),
        )
    return out
