"""Checkpoint directory -> ready model on its device, plus the facts the engine needs."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.config import EngineConfig
from services.kernels.backend import Backend
from services.models.demo import ensure_demo_model
from services.models.loader import CheckpointError, init_dummy, iter_weights, read_json
from services.models.registry import resolve

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: object
    text_config: object
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    # Identifies the weights + preprocessing, so every instance names cached embeddings alike.
    fingerprint: str

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers


def resolve_model_dir(config: EngineConfig) -> Path:
    if config.model == "demo":
        return ensure_demo_model(config.demo_dir)
    path = Path(config.model).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"model {config.model!r} is not a checkpoint directory (no config.json)"
        )
    return path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 is faster than bf16 with stock CPU kernels; bf16 is the GPU default.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def fingerprint(model_dir: Path, config: EngineConfig) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "preprocessor_config.json"):
        if (model_dir / name).exists():
            h.update((model_dir / name).read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(
        f"{config.load_format}:{config.seed if config.load_format == 'dummy' else ''}".encode()
    )
    return h.hexdigest()[:16]


def _max_model_len(text_config, config: EngineConfig) -> int:
    limit = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
    window = getattr(text_config, "sliding_window", None)
    if window and getattr(text_config, "use_sliding_window", True) and window < limit:
        # Full attention is exact only inside the window: cap the context there.
        log.warning("capping context to the sliding window (%d tokens)", window)
        limit = int(window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit}")
        limit = config.max_model_len
    return limit


def load_model(config: EngineConfig, backend: Backend) -> LoadedModel:
    from transformers import AutoConfig

    model_dir = resolve_model_dir(config)
    cls = resolve(read_json(model_dir / "config.json").get("architectures"))
    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the config of {model_dir}: {e}") from e
    text_config = getattr(hf_config, "text_config", None) or hf_config
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_len = _max_model_len(text_config, config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, backend, max_len)
    finally:
        torch.set_default_dtype(previous)
    if config.load_format == "dummy":
        init_dummy(model, config.seed)
    else:
        model.load_weights(iter_weights(model_dir))
    model.eval()
    return LoadedModel(model, hf_config, text_config, model_dir, device, dtype, max_len,
                       fingerprint(model_dir, config))  # fmt: skip
