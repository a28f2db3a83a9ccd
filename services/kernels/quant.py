"""Quantized linear weights: int8 with a scale per output column, int4 with a scale and a
zero point per group of input rows; made from fp32 weights or from a checkpoint's codes.

Decode on CPU is bound by reading the weights: int8 reads a quarter of fp32's bytes, int4
an eighth (plus its group scales). Activations stay fp32 and the codes are turned into
floats in registers by the native kernels (``csrc/epd_quant.c``), never into a full
precision copy in memory. The codes sit in that kernel's layout: panels of 16 output
columns, each panel's input rows one after another, so a panel is read as one sequential
stream. ``QuantizedWeight.dequantize`` gives back W [n, k] (what ``F.linear`` takes) for
the torch and Triton backends and for tests; ``reference_linear`` is the contract the
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 16
INT4_GROUP = 128
METHODS = ("int8", "int4")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear weight W [n, k] as codes (what ``Backend.linear`` takes in W's place)."""

    method: str  # "int8" or "int4"
    shape: tuple[int, int]  # (n, k): W's shape
    codes: torch.Tensor  # int8 [panels, k, 16] (int8); uint8 [panels, k, 8] (int4, two per byte)
    scale: torch.Tensor  # fp32 [panels * 16] (int8); [k / group, panels * 16] (int4)
    offset: torch.Tensor | None  # int4: fp32 [k / group, panels * 16], -zero * scale
    group: int  # input rows per scale (int8: k)

    @property
    def nbytes(self) -> int:
        """Memory the weight holds (codes and scales)."""
        parts = (self.codes, self.scale, self.offset)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on ``device``."""
        moved = (
            t.to(device) if t is not None else None for t in (self.codes, self.scale, self.offset)
        )
        return QuantizedWeight(self.method, self.shape, *moved, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] as the codes give it."""
        n, k = self.shape
        if self.method == "int8":
            w = _unpanel(self.codes.float(), k)  # [k, npad]
            return (w * self.scale).t()[:n].to(dtype).contiguous()
        u = _unpanel(_unpack_nibbles(self.codes).float(), k)  # [k, npad]
        scale = self.scale.repeat_interleave(self.group, dim=0)
        offset = self.offset.repeat_interleave(self.group, dim=0)
        return (u * scale + offset).t()[:n].to(dtype).contiguous()


def reference_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T + bias in float64 from the codes: what the kernels compute, up to fp32
    rounding of their sums."""
    y = x.double() @ weight.dequantize(torch.float64).t()
    return (y if bias is None else y + bias.double()).float()


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """Round-to-nearest quantization of an fp32 W [n, k]: int8 symmetric per output column,
    int4 asymmetric per group of ``INT4_GROUP`` input rows (or the largest of 64, 32 that
    divides k, else all of k)."""
    w = weight.detach().float()
    if method == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return int8_weight(codes, scale)
    if method == "int4":
        group = int4_group(w.shape[1])
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        zero = torch.round(-lo / scale).clamp(0, 15)
        codes = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
        return int4_weight(codes.reshape(w.shape).to(torch.uint8), scale, zero)
    raise ValueError(f"unknown quantization {method!r} (one of {', '.join(METHODS)})")


def int4_group(k: int) -> int:
    for group in (INT4_GROUP, 64, 32):
        if k % group == 0:
            return group
    return k


def int8_weight(codes: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """From int8 codes [n, k] and a scale per output column [n]: W = codes * scale."""
    n, k = codes.shape
    npad = _padded(n)
    return QuantizedWeight(
        "int8",
        (n, k),
        _panels(codes.to(torch.int8), npad),
        _pad_cols(scale.float().reshape(n), npad),
        None,
        k,
    )


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantizedWeight:
    """From unsigned 4-bit codes [n, k] (values 0-15, one per byte), and per output column
    and group of k / G input rows a scale [n, G] and zero point [n, G]:
    W = (codes - zero) * scale."""
    n, k = codes.shape
    groups = scale.shape[1]
    if k % groups or zero.shape != scale.shape or scale.shape[0] != n:
        raise ValueError(f"int4 scales {tuple(scale.shape)} do not fit a weight of {(n, k)}")
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("int4 codes outside 0-15")
    npad = _padded(n)
    s = scale.float()
    panels = _panels(codes.to(torch.uint8), npad)  # [panels, k, 16]
    packed = panels[..., :8] | (panels[..., 8:] << 4)
    return QuantizedWeight(
        "int4",
        (n, k),
        packed.contiguous(),
        _pad_cols(s.t().contiguous(), npad),
        _pad_cols((-zero.float() * s).t().contiguous(), npad),
        k // groups,
    )


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def _pad_cols(t: torch.Tensor, npad: int) -> torch.Tensor:
    """t [..., n] -> [..., npad], zeros past n."""
    out = torch.zeros(*t.shape[:-1], npad, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def _panels(codes: torch.Tensor, npad: int) -> torch.Tensor:
    """codes [n, k] -> [npad / 16, k, 16]: the kernels' panel layout of W^T."""
    n, k = codes.shape
    wt = torch.zeros(k, npad, dtype=codes.dtype, device=codes.device)
    wt[:, :n] = codes.t()
    return wt.reshape(k, npad // PANEL, PANEL).permute(1, 0, 2).contiguous()


def _unpanel(panels: torch.Tensor, k: int) -> torch.Tensor:
    """[npad / 16, k, 16] -> W^T [k, npad]."""
    return panels.permute(1, 0, 2).reshape(k, -1)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[panels, k, 8] bytes -> [panels, k, 16] codes (low nibbles, then high)."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)
