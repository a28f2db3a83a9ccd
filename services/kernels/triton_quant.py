"""Quantized linears on CUDA: ``x @ W^T + bias`` read from the codes of a
``QuantizedWeight`` (services/kernels/quant.py) in their own layout, never dequantized
into a full-precision copy (the torch twin, ``torch_backend.linear``, makes that copy).

The layout is the CPU kernels': panels of 16 output columns, each panel's input rows one
after another ([panels, k, 16] int8; [panels, k, 8] bytes for int4, column c of a panel
in the low nibble of byte c for c < 8, the high nibble of byte c - 8 after). One program
computes a tile of rows times one panel. int8: the products of the codes summed in fp32,
then the column's scale. int4: per group of input rows, the products of the codes times
the group's scale plus the rows' sums times its offset (-zero x scale), the CPU kernels'
decomposition. fp32 accumulation, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.quant import PANEL, QuantizedWeight
from services.kernels.triton_checks import FLOAT_DTYPES, check, check_tensor

BLOCK_M, BLOCK_K = 16, 32


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    offset_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    NPAD,
    stride_xm,
    stride_ym,
    GROUP,
    INT4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, p): rows m * BLOCK_M .. times panel p's 16 columns."""
    pid_m = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    cols = p * 16 + offs_c
    acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
            mask=(offs_m[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        if INT4:
            byte = tl.load(
                codes_ptr + p * K * 8 + kk[:, None] * 8 + (offs_c % 8)[None, :],
                mask=kk[:, None] < K,
                other=0,
            ).to(tl.int32)
            u = ((byte >> ((offs_c // 8) * 4)[None, :]) & 15).to(tl.float32)
            g = k0 // GROUP  # BLOCK_K divides GROUP: one group per pass
            s = tl.load(scale_ptr + g * NPAD + cols)
            o = tl.load(offset_ptr + g * NPAD + cols)
            acc += tl.dot(a, u) * s[None, :] + tl.sum(a, axis=1)[:, None] * o[None, :]
        else:
            w = tl.load(
                codes_ptr + p * K * 16 + kk[:, None] * 16 + offs_c[None, :],
                mask=kk[:, None] < K,
                other=0,
            ).to(tl.float32)
            acc += tl.dot(a, w)
    if not INT4:
        acc = acc * tl.load(scale_ptr + cols)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (cols[None, :] < N))


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel reads this weight (int4 groups must be whole passes of BLOCK_K)."""
    return weight.method == "int8" or weight.group % BLOCK_K == 0


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T + bias -> [M, N] in x's dtype, W read from its codes."""
    n, k = weight.shape
    check_tensor(x, "x", 2, FLOAT_DTYPES, x.device)
    check(x.shape[1] == k, f"x has {x.shape[1]} features, the weight takes {k}")
    check(takes(weight), f"int4 groups of {weight.group} rows are not a multiple of {BLOCK_K}")
    check(weight.codes.device == x.device, "the weight's codes are on another device")
    if bias is not None:
        check_tensor(bias, "bias", 1, FLOAT_DTYPES, x.device)
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    panels = weight.codes.shape[0]
    int4 = weight.method == "int4"
    grid = (triton.cdiv(x.shape[0], BLOCK_M), panels)
    _quant_linear_kernel[grid](
        x,
        weight.codes,
        weight.scale,
        weight.offset if int4 else weight.scale,
        bias if bias is not None else x,
        y,
        x.shape[0],
        n,
        k,
        panels * PANEL,
        x.stride(0),
        y.stride(0),
        weight.group,
        INT4=int4,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
    )
    return y
