"""Grouped GEMM for mixture-of-experts layers: every (token, expert) pair of a step in
one launch, each program a tile of rows that share an expert, so an expert's weight
tiles are read once per row tile instead of once per token.

``align_by_expert`` (torch, shared with the twin) sorts the pairs by expert and pads
each expert's run to a multiple of ``block_m``; ``grouped_gemm`` multiplies the gathered
rows by their expert's matrix. Numerics: fp32 accumulation, one rounding to the output
dtype, as the twin (``torch_backend.grouped_gemm``) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import FLOAT_DTYPES, check, check_tensor

BLOCK_M = 16


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """``experts`` [T, k] -> (rows [P], block_expert [P / block_m], pairs [P]): slot i of
    the padded, expert-sorted order holds token ``rows[i]`` (-1 for padding) and pair
    ``pairs[i]`` (its index in ``experts.flatten()``, -1 for padding); each block of
    ``block_m`` slots belongs to expert ``block_expert[b]``."""
    flat = experts.flatten()
    k = experts.shape[1]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    starts = torch.cumsum(padded, 0) - padded
    firsts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    slots = (
        starts[sorted_experts]
        + torch.arange(flat.numel(), device=flat.device)
        - firsts[sorted_experts]
    )
    pairs = torch.full((total,), -1, dtype=torch.long, device=flat.device)
    pairs[slots] = order
    rows = torch.where(pairs >= 0, pairs // k, -1)
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return rows, block_expert, pairs


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows_ptr,
    block_expert_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n): slots m*BLOCK_M.. of one expert times that expert's columns n."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)
    valid = rows >= 0
    rows = tl.where(valid, rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=valid[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + e * stride_we + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(offs_n[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor
) -> torch.Tensor:
    """x [T, K], weight [E, N, K] (any strides), from ``align_by_expert``: rows [P] and
    block_expert [P / BLOCK_M] -> y [P, N], slot i = x[rows[i]] @ weight[e].T (padding
    slots: zeros)."""
    check_tensor(x, "x", 2, FLOAT_DTYPES, x.device, last_contiguous=False)
    check_tensor(weight, "weight", 3, (x.dtype,), x.device, last_contiguous=False)
    check(weight.shape[2] == x.shape[1], "weight's in-features differ from x's")
    check(rows.numel() == block_expert.numel() * BLOCK_M, "rows are not padded to BLOCK_M")
    n, k = weight.shape[1], weight.shape[2]
    y = torch.zeros(rows.numel(), n, dtype=x.dtype, device=x.device)
    if rows.numel() == 0:
        return y
    grid = (block_expert.numel(), triton.cdiv(n, 32))
    _grouped_gemm_kernel[grid](
        x,
        weight,
        y,
        rows,
        block_expert,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=32,
        BLOCK_K=32,
    )
    return y
