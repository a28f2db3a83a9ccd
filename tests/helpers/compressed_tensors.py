"""compressed-tensors checkpoints written as llm-compressor writes them (its config and
tensor names; codes packed eight to an int32, value i at bits 4i, stored as code + 8),
from a full-precision checkpoint, round-to-nearest; plus the dequantized twin that
transformers runs as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit values -> int32 words of eight along ``dim`` (dim's size % 8 == 0)."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def _int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def _int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / 15
    zero = torch.round(-lo / scale) - 8  # signed, as compressed-tensors keeps it
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(-8, 7)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    parts = {
        "weight_packed": _pack(q.reshape(n, k) + 8, dim=1),
        "weight_scale": scale,
        "weight_zero_point": _pack(zero + 8, dim=0),
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }
    return parts, deq


def write_compressed(src: Path, out: Path, bits: int, group: int = 32) -> tuple[Path, Path]:
    """(the compressed-tensors checkpoint of src, its dequantized full-precision twin)."""
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
            parts, deq = _int8(t.float()) if bits == 8 else _int4(t.float(), group)
            packed.update({f"{module}.{p}": v for p, v in parts.items()})
            plain[name] = deq
        else:
            packed[name] = plain[name] = t
    save_file(packed, str(out / "model.safetensors"))
    save_file(plain, str(twin / "model.safetensors"))
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
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if bits == 8 else "pack-quantized",
        "config_groups": {"group_0": group0},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, twin
