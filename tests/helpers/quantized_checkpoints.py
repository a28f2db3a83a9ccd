"""Quantized checkpoints written as the tools that publish them write them, from a
full-precision checkpoint, round-to-nearest, plus the dequantized twin that transformers
runs as the reference:

- compressed-tensors, as llm-compressor writes it (its config and tensor names; int4
  codes packed eight to an int32, value i at bits 4i, stored as code + 8);
- GPTQ (``qweight`` packed along the inputs, ``qzeros`` along the outputs, fp16
  ``scales``, ``g_idx``; v1 files store zero - 1);
- AWQ's GEMM layout (both packed along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit values -> int32 words of eight along ``dim`` (dim's size % 8 == 0)."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def _int8(w: torch.Tensor):
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def _int4_codes(w: torch.Tensor, group: int, fp16_scales: bool = False):
    """(codes [n, k] 0-15, scales [n, G], zero points [n, G] 1-15, dequantized [n, k])."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / 15
    if fp16_scales:
        scale = scale.half().float()
    zero = torch.round(-lo / scale).clamp(1, 15)  # >= 1: GPTQ v1 stores zero - 1
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    return q.reshape(n, k), scale, zero, deq


def _compressed_int4(w: torch.Tensor, group: int):
    q, scale, zero, deq = _int4_codes(w, group)
    n, k = w.shape
    parts = {
        "weight_packed": _pack(q, dim=1),
        "weight_scale": scale,
        "weight_zero_point": _pack(zero, dim=0),
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }
    return parts, deq


def _gptq(w: torch.Tensor, group: int):
    q, scale, zero, deq = _int4_codes(w, group, fp16_scales=True)
    k = w.shape[1]
    parts = {
        "qweight": _pack(q.t(), dim=0),
        "qzeros": _pack(zero.t() - 1, dim=1),
        "scales": scale.t().half().contiguous(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }
    return parts, deq


def _awq_order(values: torch.Tensor) -> torch.Tensor:
    """[rows, out] in column order -> in AWQ's packed order (nibble i: column ORDER[i])."""
    rows, cols = values.shape
    return values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols)


def _awq(w: torch.Tensor, group: int):
    q, scale, zero, deq = _int4_codes(w, group, fp16_scales=True)
    parts = {
        "qweight": _pack(_awq_order(q.t()), dim=1),
        "qzeros": _pack(_awq_order(zero.t()), dim=1),
        "scales": scale.t().half().contiguous(),
    }
    return parts, deq


def _write(src: Path, out: Path, quantize: Callable, config: dict) -> tuple[Path, Path]:
    """(the quantized checkpoint of src, its dequantized full-precision twin)."""
    twin = out.with_name(out.name + "-dequantized")
    if (out / "config.json").exists():
        return out, twin
    for d in (out, twin):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    packed, plain = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in _LINEARS:
            parts, deq = quantize(t.float())
            packed.update({f"{module}.{p}": v for p, v in parts.items()})
            plain[name] = deq
        else:
            packed[name] = plain[name] = t
    save_file(packed, str(out / "model.safetensors"))
    save_file(plain, str(twin / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, twin


def write_compressed(src: Path, out: Path, bits: int, group: int = 32) -> tuple[Path, Path]:
    """A compressed-tensors checkpoint: int8 per channel (W8A8) or int4 per group."""
    weights = {"num_bits": bits, "type": "int", "symmetric": bits == 8, "dynamic": False}
    weights |= {"strategy": "channel"} if bits == 8 else {"strategy": "group", "group_size": group}
    group0 = {"targets": ["Linear"], "weights": weights}
    if bits == 8:
        group0["input_activations"] = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if bits == 8 else "pack-quantized",
        "config_groups": {"group_0": group0},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    quantize = _int8 if bits == 8 else (lambda w: _compressed_int4(w, group))
    return _write(src, out, quantize, config)


def write_gptq(src: Path, out: Path, group: int = 32) -> tuple[Path, Path]:
    """A GPTQ int4 checkpoint (v1 format, asymmetric, no act-order)."""
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    return _write(src, out, lambda w: _gptq(w, group), config)


def write_awq(src: Path, out: Path, group: int = 32) -> tuple[Path, Path]:
    """An AWQ int4 checkpoint in the GEMM layout, with zero points."""
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "version": "gemm",
        "zero_point": True,
    }
    return _write(src, out, lambda w: _awq(w, group), config)
