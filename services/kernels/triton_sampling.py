"""Sampling: temperature, top-k / top-p / min-p masking and Gumbel-max, one kernel.

Each program owns BLOCK_B rows and streams the vocabulary in BLOCK_V chunks, so the
[B, V] logits are never sorted or copied. Thresholds are found by binary search over an
order-preserving int32 image of the fp32 scaled logits (``_float_key``), which makes the
top-k threshold exact (ties at the k-th value are kept, like the twin):
  * top-k: the largest key t with count(key >= t) >= k, i.e. the k-th largest value;
  * top-p: the smallest key t whose strictly-greater mass is < top_p * Z, which keeps a
    token iff the mass of the tokens above it is below top_p (the twin's exclusive cumsum);
  * min-p: p / p_max = exp(s - max) >= min_p, no normalisation needed.
Masked tokens get -inf. Noise: Gumbel(u) with u = philox(key = splitmix64(seed, position),
counter = vocab index), so a row's draw depends on (seed, position, logits) only, never on
its batch. Greedy rows (temperature 0) take the first maximal logit, like ``argmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.metadata import SamplingTensors
from services.kernels.triton_checks import check, check_tensor

_TILE = 2048  # elements per chunk (BLOCK_B * BLOCK_V)
_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def mix_seed(seed, pos):
    """splitmix64 of (seed, position), bit-identical to ``torch_backend.mix_seed``."""
    z = seed.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    z = z + pos.to(tl.uint64, bitcast=True) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return ((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF).to(tl.int64, bitcast=True)


@triton.jit
def _float_key(x):
    """fp32 -> int64 with a < b iff key(a) < key(b): negative floats get their magnitude flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V: tl.constexpr):
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
        s, _, _ = _chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        m = tl.maximum(m, tl.max(s, axis=1))
    return m


@triton.jit
def _count_ge(
    logits_ptr, rows, r_mask, stride, temp, t, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """count(key >= t), the smallest key >= t and the largest key < t (token keys only)."""
    c = tl.zeros([BLOCK_B], tl.int32)
    above = tl.full([BLOCK_B], _INT32_MAX, tl.int64)
    below = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        s, inside, _ = _chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        key = _float_key(s)
        ge = inside & (key >= t[:, None])
        c += tl.sum(ge.to(tl.int32), axis=1)
        above = tl.minimum(above, tl.min(tl.where(ge, key, _INT32_MAX), axis=1))
        below = tl.maximum(below, tl.max(tl.where(inside & ~ge, key, _INT32_MIN), axis=1))
    return c, above, below


@triton.jit
def _mass_gt(
    logits_ptr, rows, r_mask, stride, temp, m, t, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Unnormalised mass sum(exp(s - m)) of the keys > t, the smallest key > t, the largest <= t."""
    z = tl.zeros([BLOCK_B], tl.float32)
    above = tl.full([BLOCK_B], _INT32_MAX, tl.int64)
    below = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        s, inside, _ = _chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        key = _float_key(s)
        gt = inside & (key > t[:, None])
        z += tl.sum(tl.where(gt, tl.exp(s - m[:, None]), 0.0), axis=1)
        above = tl.minimum(above, tl.min(tl.where(gt, key, _INT32_MAX), axis=1))
        below = tl.maximum(below, tl.max(tl.where(inside & ~gt, key, _INT32_MIN), axis=1))
    return z, above, below


# Both searches bisect [lo, hi] and then snap each end to the nearest real token key on its
# side, so they stop as soon as at most two tokens are left inside, after about log2(V)
# passes for spread-out logits instead of the 32 that bisecting the int32 range would take.


@triton.jit
def _top_k_key(
    logits_ptr, rows, r_mask, stride, temp, k, top, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Key of the k-th largest scaled logit (rows with top-k off: INT32_MIN, keeps all)."""
    lo = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
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
def _argmax_update(val, v0, best, idx):
    """Running argmax that keeps the first maximal index across chunks (like torch.argmax)."""
    c_max = tl.max(val, axis=1)
    c_idx = tl.argmax(val, axis=1, tie_break_left=True) + v0
    take = c_max > best
    return tl.where(take, c_max, best), tl.where(take, c_idx, idx)


@triton.jit
def _draw(
    logits_ptr,
    rows,
    r_mask,
    stride,
    temp,
    thr,
    m,
    min_p,
    seed,
    V,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    USE_MIN_P: tl.constexpr,
):
    """One pass: greedy argmax and Gumbel-max over the kept tokens; returns the row's token."""
    best_g = tl.full([BLOCK_B], float("-inf"), tl.float32)
    best_s = tl.full([BLOCK_B], float("-inf"), tl.float32)
    idx_g = tl.zeros([BLOCK_B], tl.int32)
    idx_s = tl.zeros([BLOCK_B], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        s, inside, offs = _chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        best_g, idx_g = _argmax_update(s, v0, best_g, idx_g)  # temp is 1 on greedy rows
        if not ALL_GREEDY:
            keep = inside & (_float_key(s) >= thr[:, None])
            if USE_MIN_P:
                keep = keep & (tl.exp(s - m[:, None]) >= min_p[:, None])
            # Same clamp as the twin: u in [1e-10, 1 - 1e-7] keeps -log(-log(u)) finite.
            u = tl.rand(seed[:, None], tl.broadcast_to(offs[None, :], [BLOCK_B, BLOCK_V]))
            u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
            g = -tl.log(-tl.log(u))
            best_s, idx_s = _argmax_update(tl.where(keep, s + g, float("-inf")), v0, best_s, idx_s)
    return idx_g, idx_s


@triton.jit
def _keep_threshold(
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
    thr = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
    m = tl.zeros([BLOCK_B], tl.float32)
    if USE_TOP_K or USE_TOP_P or USE_MIN_P:
        m = _row_max(logits_ptr, rows, r_mask, stride, temp, V, BLOCK_B, BLOCK_V)
    top = _float_key(m)
    if USE_TOP_K:
        k = tl.load(top_k_ptr + rows, mask=r_mask, other=0)
        thr = _top_k_key(logits_ptr, rows, r_mask, stride, temp, k, top, V, BLOCK_B, BLOCK_V)
    if USE_TOP_P:
        p = tl.load(top_p_ptr + rows, mask=r_mask, other=1.0)
        thr = _top_p_key(
            logits_ptr, rows, r_mask, stride, temp, p, m, thr, top, V, BLOCK_B, BLOCK_V
        )
    return thr, m


@triton.jit
def _sample_kernel(
    logits_ptr,
    out_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    pos_ptr,
    B,
    V,
    stride,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
):
    """Program: BLOCK_B rows; masks only what the constexpr flags say some row uses."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    r_mask = rows < B
    t_raw = tl.load(temp_ptr + rows, mask=r_mask, other=1.0)
    temp = tl.where(t_raw > 0, t_raw, 1.0)
    rows64 = rows.to(tl.int64)
    thr = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
    m = tl.zeros([BLOCK_B], tl.float32)
    min_p = tl.zeros([BLOCK_B], tl.float32)
    seed = tl.zeros([BLOCK_B], tl.int64)
    if not ALL_GREEDY:
        seed = mix_seed(
            tl.load(seed_ptr + rows, mask=r_mask, other=0),
            tl.load(pos_ptr + rows, mask=r_mask, other=0),
        )
        thr, m = _keep_threshold(
            logits_ptr,
            top_k_ptr,
            top_p_ptr,
            rows64,
            r_mask,
            stride,
            temp,
            V,
            BLOCK_B,
            BLOCK_V,
            USE_TOP_K,
            USE_TOP_P,
            USE_MIN_P,
        )
        if USE_MIN_P:
            min_p = tl.load(min_p_ptr + rows, mask=r_mask, other=0.0)
    idx_g, idx_s = _draw(
        logits_ptr,
        rows64,
        r_mask,
        stride,
        temp,
        thr,
        m,
        min_p,
        seed,
        V,
        BLOCK_B,
        BLOCK_V,
        ALL_GREEDY,
        USE_MIN_P,
    )
    tl.store(out_ptr + rows, tl.where(t_raw > 0, idx_s, idx_g).to(tl.int64), mask=r_mask)


def _check_sampling(logits: torch.Tensor, t: SamplingTensors) -> None:
    dev = logits.device
    check_tensor(logits, "logits", 2, (torch.float32,), dev)
    b = logits.shape[0]
    for name, dtype in (
        ("temperature", torch.float32),
        ("top_k", torch.int32),
        ("top_p", torch.float32),
        ("min_p", torch.float32),
        ("seeds", torch.int64),
        ("positions", torch.int64),
    ):
        tensor = getattr(t, name)
        check_tensor(tensor, name, 1, (dtype,), dev)
        check(tensor.shape[0] == b and tensor.is_contiguous(), f"{name} must be [B] contiguous")


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64; greedy rows (temperature 0) are argmax."""
    _check_sampling(logits, t)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    block_v = min(triton.next_power_of_2(v), _TILE)
    block_b = max(1, min(_TILE // block_v, triton.next_power_of_2(b)))
    _sample_kernel[(triton.cdiv(b, block_b),)](
        logits,
        out,
        t.temperature,
        t.top_k,
        t.top_p,
        t.min_p,
        t.seeds,
        t.positions,
        b,
        v,
        logits.stride(0),
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        ALL_GREEDY=t.all_greedy,
        USE_TOP_K=not t.no_top_k,
        USE_TOP_P=not t.no_top_p,
        USE_MIN_P=not t.no_min_p,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out
