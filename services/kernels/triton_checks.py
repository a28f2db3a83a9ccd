"""Argument checks shared by the Triton launchers (shapes, dtypes, strides, devices).

Every launcher validates its inputs here before it launches: a wrong stride or dtype in a
Triton kernel reads garbage instead of raising, so the launcher is where it must fail.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def check_tensor(
    t: torch.Tensor,
    name: str,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    last_contiguous: bool = True,
) -> None:
    """Rank, dtype and device of ``t``; with ``last_contiguous`` its last stride must be 1."""
    check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    check(t.dtype in dtypes, f"{name} dtype {t.dtype} not in {dtypes}")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
    if last_contiguous and t.numel() > 0:
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, device: torch.device) -> None:
    """Both caches [num_blocks, block_size, Hkv, D], same shape and dtype."""
    check_tensor(k_cache, "k_cache", 4, FLOAT_DTYPES, device)
    check_tensor(v_cache, "v_cache", 4, FLOAT_DTYPES, device)
    check(
        k_cache.shape == v_cache.shape,
        f"k/v cache shapes differ: {k_cache.shape} vs {v_cache.shape}",
    )
    check(k_cache.dtype == v_cache.dtype, "k/v cache dtypes differ")


def check_gqa(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query [T, Hq, D] against a cache [.., .., Hkv, D]; returns the group size Hq // Hkv."""
    hq, d = query.shape[1], query.shape[2]
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    check(d == dk, f"query head_dim {d} != cache head_dim {dk}")
    check(hq % hkv == 0, f"query heads {hq} not a multiple of kv heads {hkv}")
    return hq // hkv


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal H100 count elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
