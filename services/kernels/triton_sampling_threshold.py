"""Sampling's keep threshold: the top-k / top-p cut of each row, found without a sort.

Thresholds are found by binary search over an order-preserving int32 image of the fp32
scaled logits (``float_key``), streamed in BLOCK_V chunks, which makes the top-k
threshold exact (ties at the k-th value are kept, like the twin):
  * top-k: the largest key t with count(key >= t) >= k, i.e. the k-th largest value;
  * top-p: the smallest key t whose strictly-greater mass is < top_p * Z, which keeps a
    token iff the mass of the tokens above it is below top_p (the twin's exclusive cumsum).
``keep_threshold`` runs both for ``triton_sampling._sample_kernel``.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def float_key(x):
    """fp32 -> int64 with a < b iff key(a) < key(b): negative floats get their magnitude flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def scaled_chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V: tl.constexpr):
    """Scaled logits s = logits / T of one chunk (out-of-range lanes -inf) and their mask."""
    offs = v0 + tl.arange(0, BLOCK_V)
    inside = r_mask[:, None] & (offs < V)[None, :]
    x = tl.load(
        logits_ptr + rows[:, None] * stride + offs[None, :], mask=inside, other=float("-inf")
    )
    return x / temp[:, None], inside, offs


@triton.jit
def _row_max(
    logits_ptr, rows, r_mask, stride, temp, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    m = tl.full([BLOCK_B], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        s, _, _ = scaled_chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        m = tl.maximum(m, tl.max(s, axis=1))
    return m


@triton.jit
def _count_ge(
    logits_ptr, rows, r_mask, stride, temp, t, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """count(key >= t), the smallest key >= t and the largest key < t (token keys only)."""
    c = tl.zeros([BLOCK_B], tl.int32)
    above = tl.full([BLOCK_B], INT32_MAX, tl.int64)
    below = tl.full([BLOCK_B], INT32_MIN, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        s, inside, _ = scaled_chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        key = float_key(s)
        ge = inside & (key >= t[:, None])
        c += tl.sum(ge.to(tl.int32), axis=1)
        above = tl.minimum(above, tl.min(tl.where(ge, key, INT32_MAX), axis=1))
        below = tl.maximum(below, tl.max(tl.where(inside & ~ge, key, INT32_MIN), axis=1))
    return c, above, below


@triton.jit
def _mass_gt(
    logits_ptr, rows, r_mask, stride, temp, m, t, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Unnormalised mass sum(exp(s - m)) of the keys > t, the smallest key > t, the largest <= t."""
    z = tl.zeros([BLOCK_B], tl.float32)
    above = tl.full([BLOCK_B], INT32_MAX, tl.int64)
    below = tl.full([BLOCK_B], INT32_MIN, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        s, inside, _ = scaled_chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        key = float_key(s)
        gt = inside & (key > t[:, None])
        z += tl.sum(tl.where(gt, tl.exp(s - m[:, None]), 0.0), axis=1)
        above = tl.minimum(above, tl.min(tl.where(gt, key, INT32_MAX), axis=1))
        below = tl.maximum(below, tl.max(tl.where(inside & ~gt, key, INT32_MIN), axis=1))
    return z, above, below


# Both searches bisect [lo, hi] and then snap each end to the nearest real token key on its
# side, so they stop as soon as at most two tokens are left inside, after about log2(V)
# passes for spread-out logits instead of the 32 that bisecting the int32 range would take.


@triton.jit
def _top_k_key(
    logits_ptr, rows, r_mask, stride, temp, k, top, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Key of the k-th largest scaled logit (rows with top-k off: INT32_MIN, keeps all)."""
    lo = tl.full([BLOCK_B], INT32_MIN, tl.int64)
    hi = tl.where((k > 0) & (k < V), top, lo)
    while tl.max(hi - lo, axis=0) > 0:  # invariant: count(key >= lo) >= k >= count(key > hi)
        mid = (lo + hi + 1) >> 1
        c, above, below = _count_ge(
            logits_ptr, rows, r_mask, stride, temp, mid, V, BLOCK_B, BLOCK_V
        )
        ok = c >= k
        lo = tl.where(ok & (hi > lo), above, lo)
        hi = tl.where(ok | (hi == lo), hi, below)
    return lo


@triton.jit
def _top_p_key(
    logits_ptr,
    rows,
    r_mask,
    stride,
    temp,
    p,
    m,
    floor,
    top,
    V,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Smallest key t >= floor with mass(key > t) < p * mass(key >= floor); p >= 1: floor."""
    total, _, _ = _mass_gt(
        logits_ptr, rows, r_mask, stride, temp, m, floor - 1, V, BLOCK_B, BLOCK_V
    )
    lo = floor
    hi = tl.where(p < 1.0, top, floor)
    while tl.max(hi - lo, axis=0) > 0:  # invariant: mass(key > hi) < p * total
        mid = (lo + hi) >> 1
        z, above, below = _mass_gt(
            logits_ptr, rows, r_mask, stride, temp, m, mid, V, BLOCK_B, BLOCK_V
        )
        ok = z < p * total
        hi = tl.where(ok & (hi > lo), tl.maximum(below, lo), hi)
        lo = tl.where(ok | (hi == lo), lo, above)
    return lo


@triton.jit
def keep_threshold(
    logits_ptr,
    top_k_ptr,
    top_p_ptr,
    rows,
    r_mask,
    stride,
    temp,
    V,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
):
    """(key threshold of top-k then top-p, row max m of the scaled logits)."""
    thr = tl.full([BLOCK_B], INT32_MIN, tl.int64)
    m = tl.zeros([BLOCK_B], tl.float32)
    if USE_TOP_K or USE_TOP_P or USE_MIN_P:
        m = _row_max(logits_ptr, rows, r_mask, stride, temp, V, BLOCK_B, BLOCK_V)
    top = float_key(m)
    if USE_TOP_K:
        k = tl.load(top_k_ptr + rows, mask=r_mask, other=0)
        thr = _top_k_key(logits_ptr, rows, r_mask, stride, temp, k, top, V, BLOCK_B, BLOCK_V)
    if USE_TOP_P:
        p = tl.load(top_p_ptr + rows, mask=r_mask, other=1.0)
        thr = _top_p_key(
            logits_ptr, rows, r_mask, stride, temp, p, m, thr, top, V, BLOCK_B, BLOCK_V
        )
    return thr, m
