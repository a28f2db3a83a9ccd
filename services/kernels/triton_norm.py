"""RMSNorm with an optional fused residual add.

Numerics follow the torch twin exactly: the residual sum is rounded to the input dtype
(it is also what the next layer adds to), the mean of squares and ``rsqrt`` are fp32, the
normalized row is rounded to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels.triton_checks import FLOAT_DTYPES, check, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Program t: one row of ``HIDDEN`` features."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(x_ptr.dtype.element_ty)  # rounded like the eager add
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)  # padded lanes are 0: no effect
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with residual: (norm(x + residual) * weight, x + residual)."""
    dev = x.device
    check_tensor(x, "x", 2, FLOAT_DTYPES, dev)
    check_tensor(weight, "weight", 1, FLOAT_DTYPES, dev)
    check(
        weight.shape[0] == x.shape[1] and weight.is_contiguous(), "weight must be [H], contiguous"
    )
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.promote_types(x.dtype, weight.dtype), device=dev)
    res_out = None
    if residual is not None:
        check_tensor(residual, "residual", 2, FLOAT_DTYPES, dev)
        check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x")
        res_out = torch.empty_like(x)
    if t > 0:
        r, ro = (residual, res_out) if residual is not None else (x, x)
        _rms_norm_kernel[(t,)](
            x,
            r,
            weight,
            out,
            ro,
            eps,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            ro.stride(0),
            HIDDEN=h,
            BLOCK_H=triton.next_power_of_2(h),
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if h <= 4096 else 8,
        )
    return out if res_out is None else (out, res_out)
