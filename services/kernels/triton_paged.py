"""The paged online-softmax core both attention kernels share: gather K/V tiles through
a block table and fold them into a running softmax (``attend_paged``).

Numerics: scores are computed in fp32 and kept in log2 units (``scale * log2(e)`` folded
into the query scale) so the online softmax uses ``exp2``. The running max starts at a
large finite negative (``-1e30``) and masked scores are ``-inf``: ``exp2(-inf - m)`` is 0
without ever producing ``-inf - -inf = NaN``, even for a tile with no valid key.
Used by decode (triton_attention.py) and prefill / extend (triton_extend.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max


@triton.jit
def load_kv_tile(
    cache_ptr,
    table_ptr,
    tok,
    valid,
    head,
    offs_d,
    d_mask,
    stride_blk,
    stride_tok,
    stride_head,
    PAGE: tl.constexpr,
):
    """Gather the [BLOCK_N, BLOCK_D] rows of tokens ``tok`` through one block-table row."""
    block = tl.load(table_ptr + tok // PAGE, mask=valid, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + block[:, None] * stride_blk
        + (tok % PAGE)[:, None] * stride_tok
        + head * stride_head
        + offs_d[None, :]
    )
    return tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def dot_acc32(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs use exact fp32 products, not tf32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_paged(
    q,
    k_ptr,
    v_ptr,
    table,
    start,
    end,
    last_key,
    kvh,
    offs_d,
    d_mask,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Online softmax of q [ROWS, D] over keys start..end-1; row r sees keys <= last_key[r].

    Returns the fp32 (acc, running max m, sum l); the output is acc / l.
    """
    m = tl.full([ROWS], _NEG_BIG, tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        k = load_kv_tile(
            k_ptr, table, tok, valid, kvh, offs_d, d_mask, stride_kb, stride_kt, stride_kh, PAGE
        )
        s = dot_acc32(q, tl.trans(k), IEEE) * qk_scale  # [ROWS, BLOCK_N] fp32, log2 units
        s = tl.where(valid[None, :] & (tok[None, :] <= last_key[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = load_kv_tile(
            v_ptr, table, tok, valid, kvh, offs_d, d_mask, stride_vb, stride_vt, stride_vh, PAGE
        )
        # P is rounded to the cache dtype for the tensor-core product, as in FlashAttention.
        acc = acc * alpha[:, None] + dot_acc32(p.to(v.dtype), v, IEEE)
        m = m_new
    return acc, m, l_sum
