"""Offline loading of Hugging Face checkpoint directories (safetensors, sharded or not)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.models.checkpoint import CheckpointError, read_json

log = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint, from its index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_weights(model_dir: Path, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard (those ``keep(name)`` accepts),
    failing clearly on corruption."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read weights from {path.name}: {e}") from e


def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    """Copy named tensors into a module's parameters and buffers, all of them required."""
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    missing = [n for n in params if n not in weights]
    persistent = set(module.state_dict())
    missing = [n for n in missing if n in persistent]
    if missing:
        raise CheckpointError(f"{what}: weights missing from the checkpoint: {missing[:8]}")
    for name, tensor in weights.items():
        if name not in params:
            continue
        copy_param(params[name], tensor, f"{what}.{name}")


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise CheckpointError(
            f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def init_dummy(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for ``load_format="dummy"``: normal(0, std) matrices, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
