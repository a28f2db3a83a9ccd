"""Paged prefill / extend attention over a packed variable-length batch.

Each sequence's new query rows sit at the end of its context: row i of sequence b (of
q_len new rows, seq_len keys in all) attends causally to keys ``0 .. seq_len - q_len + i``,
i.e. its cached prefix (prefix-cache hits, earlier prefill chunks) plus the new tokens,
whose K/V the caller has already written to the cache. One loop over the paged cache
covers both parts. Numerics as in ``triton_paged``: fp32 scores in log2 units, online
softmax with a finite ``-1e30`` start for the running max and ``-inf`` for masked scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import check, check_gqa, check_kv_cache, check_tensor
from services.kernels.triton_paged import LOG2E, attend_paged

_BLOCK_M = 64  # query rows per program
_BLOCK_N = 64  # keys per inner iteration


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    qk_scale,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (row tile, seq b, query head): BLOCK_M new rows of one head of one sequence."""
    tile, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask, d_mask = rows < q_len, offs_d < HEAD_DIM
    mask = r_mask[:, None] & d_mask[None, :]
    t_rows = (q_start + rows).to(tl.int64)[:, None]  # packed row index of each new token
    q = tl.load(q_ptr + t_rows * stride_qt + h * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    acc, _, l_sum = attend_paged(
        q,
        k_ptr,
        v_ptr,
        table_ptr + b * stride_tb,
        0,
        tl.minimum(seq_len, seq_len - q_len + tile * BLOCK_M + BLOCK_M),  # the tile's causal end
        seq_len - q_len + rows,
        h // GROUP,
        offs_d,
        d_mask,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        BLOCK_M,
        BLOCK_D,
        BLOCK_N,
        PAGE,
        IEEE,
    )
    # Every real row sees key 0, so l_sum > 0 there; padded rows are never stored.
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = out_ptr + t_rows * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_extend(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> int:
    dev = query.device
    check_tensor(query, "query", 3, (torch.float32, torch.float16, torch.bfloat16), dev)
    check_kv_cache(k_cache, v_cache, dev)
    group = check_gqa(query, k_cache)
    check_tensor(block_tables, "block_tables", 2, (torch.int32,), dev)
    check_tensor(query_start_loc, "query_start_loc", 1, (torch.int32,), dev)
    check_tensor(seq_lens, "seq_lens", 1, (torch.int32,), dev)
    b = seq_lens.shape[0]
    check(query_start_loc.shape[0] == b + 1, "query_start_loc must have B + 1 entries")
    check(block_tables.shape[0] == b, "block_tables must have one row per sequence")
    return group


def extend_attention(
    query: torch.Tensor,  # [T, Hq, D], packed new rows of B sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32; rows may be strided
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, cached + new
    max_query_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D], query's dtype
    """Causal attention of each sequence's new rows over its cached prefix plus the new rows."""
    group = _check_extend(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    t, hq, d = query.shape
    out = torch.empty_like(query)
    b = seq_lens.shape[0]
    if t == 0 or b == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, _BLOCK_M), b, hq)
    _extend_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        PAGE=k_cache.shape[1],
        BLOCK_M=_BLOCK_M,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=_BLOCK_N,
        IEEE=k_cache.dtype == torch.float32,
        num_warps=4,
    )
    return out
