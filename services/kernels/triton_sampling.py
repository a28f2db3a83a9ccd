"""Sampling: temperature, top-k / top-p / min-p masking and Gumbel-max, one kernel.

Each program owns BLOCK_B rows and streams the vocabulary in BLOCK_V chunks, so the
[B, V] logits are never sorted or copied. The top-k / top-p threshold comes from a
binary search over order-preserving keys (triton_sampling_threshold.py); min-p keeps
p / p_max = exp(s - max) >= min_p, no normalisation needed.
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
from services.kernels.triton_sampling_threshold import (
    INT32_MIN,
    float_key,
    keep_threshold,
    scaled_chunk,
)

_TILE = 2048  # elements per chunk (BLOCK_B * BLOCK_V)


@triton.jit
def mix_seed(seed, pos):
    """splitmix64 of (seed, position), bit-identical to ``torch_backend.mix_seed``."""
    z = seed.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    z = z + pos.to(tl.uint64, bitcast=True) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return ((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF).to(tl.int64, bitcast=True)


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
        s, inside, offs = scaled_chunk(logits_ptr, rows, r_mask, stride, temp, v0, V, BLOCK_V)
        best_g, idx_g = _argmax_update(s, v0, best_g, idx_g)  # temp is 1 on greedy rows
        if not ALL_GREEDY:
            keep = inside & (float_key(s) >= thr[:, None])
            if USE_MIN_P:
                keep = keep & (tl.exp(s - m[:, None]) >= min_p[:, None])
            # Same clamp as the twin: u in [1e-10, 1 - 1e-7] keeps -log(-log(u)) finite.
            u = tl.rand(seed[:, None], tl.broadcast_to(offs[None, :], [BLOCK_B, BLOCK_V]))
            u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
            g = -tl.log(-tl.log(u))
            best_s, idx_s = _argmax_update(tl.where(keep, s + g, float("-inf")), v0, best_s, idx_s)
    return idx_g, idx_s


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
    thr = tl.full([BLOCK_B], INT32_MIN, tl.int64)
    m = tl.zeros([BLOCK_B], tl.float32)
    min_p = tl.zeros([BLOCK_B], tl.float32)
    seed = tl.zeros([BLOCK_B], tl.int64)
    if not ALL_GREEDY:
        seed = mix_seed(
            tl.load(seed_ptr + rows, mask=r_mask, other=0),
            tl.load(pos_ptr + rows, mask=r_mask, other=0),
        )
        thr, m = keep_threshold(
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
