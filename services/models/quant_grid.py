"""What a quantized checkpoint's linears are read into, whatever its format
(``quantized_checkpoint.py`` for compressed-tensors, ``gptq_awq.py`` for GPTQ and AWQ)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

SUPPORTED = (
    "compressed-tensors checkpoints with int weights of 8 bits per channel or 4 bits per "
    "group or channel; GPTQ (4 bits, without act-order) and AWQ (4 bits, GEMM layout) "
    "checkpoints; or `--quantization int8|int4` on a full-precision checkpoint"
)


@dataclass(frozen=True)
class Scheme:
    """The weight quantization a checkpoint declares (one config group, Linear targets)."""

    method: str  # compressed-tensors, gptq or awq
    bits: int  # 8 or 4
    group: int | None  # input rows per scale; None: per output channel
    symmetric: bool
    packed: bool  # codes packed eight to an int32 (pack-quantized)
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns kept in full precision
    zero_offset: int = 0  # added to stored zero points (GPTQ's v1 files store zero - 1)

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after the module's) a quantized linear is stored as."""
        if self.method == "compressed-tensors":
            return ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
        return ("qweight", "qzeros", "scales", "g_idx")

    def quantized(self, parts: dict[str, torch.Tensor]) -> bool:
        """Whether a module's parts are a quantized linear's (else a full-precision one)."""
        return ("weight_scale" if self.method == "compressed-tensors" else "qweight") in parts

    def ignores(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern:
                return True
        return False


@dataclass(frozen=True)
class Grid:
    """One checkpoint linear's codes [n, k] (int8 signed; int4 unsigned 0-15) and scales
    [n] (int8) or scales and zero points [n, groups] (int4)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        if self.bits == 8:
            return self.codes.float() * self.scale[:, None]
        groups = self.scale.shape[1]
        rep = self.codes.shape[1] // groups
        zero = self.zero.repeat_interleave(rep, dim=1)
        return (self.codes.float() - zero) * self.scale.float().repeat_interleave(rep, dim=1)


def int4_grid(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Grid:
    """An int4 Grid of codes [n, k] and scales and zero points [n, groups]; ValueError
    when their shapes disagree."""
    n, k = codes.shape
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1] or zero.shape != scale.shape:
        raise ValueError(
            f"codes {tuple(codes.shape)}, scales {tuple(scale.shape)}, zero points "
            f"{tuple(zero.shape)}"
        )
    return Grid(4, codes.to(torch.uint8), scale.float(), zero.float())


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of eight 4-bit values (value i at bits 4i) -> those values, unsigned,
    spread along ``dim``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes are {packed.dtype}, not int32")
    vals = torch.stack([(packed >> (4 * i)) & 15 for i in range(8)], dim=dim + 1)
    shape = list(packed.shape)
    shape[dim] *= 8
    return vals.reshape(shape)
