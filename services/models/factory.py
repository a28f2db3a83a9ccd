"""Checkpoint directory -> ready model on its device, plus the facts the engine needs."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.config import EngineConfig
from services.kernels.backend import Backend
from services.kernels.cpu_native import return_freed_memory
from services.models.info import ModelInfo
from services.models.loader import init_dummy, iter_weights
from services.models.quantize import quantize_linears
from services.models.quantized_checkpoint import apply_grids, read_grids, scheme_of
from services.models.registry import resolve

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    model: nn.Module
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.info.text_config.num_hidden_layers

    @property
    def num_kv_layers(self) -> int:
        """Layers with paged KV: every layer, or a hybrid model's attention layers."""
        return getattr(self.model, "num_kv_layers", self.num_layers)

    @property
    def model_dir(self) -> Path:
        return self.info.model_dir

    @property
    def text_config(self):
        return self.info.text_config

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def image_embedding_width(self) -> int:
        """Columns of an image's embedding: the decoder's hidden size, or more where the
        model carries extra features per image token (Qwen3-VL's DeepStack)."""
        return getattr(self.model, "image_embedding_width", self.text_config.hidden_size)

    @property
    def fingerprint(self) -> str:
        """Same weights + preprocessing -> same name for cached embeddings on every host."""
        return self.info.fingerprint


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 is faster than bf16 with stock CPU kernels; bf16 is the GPU default.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(config: EngineConfig, backend: Backend) -> LoadedModel:
    info = ModelInfo.load(config)
    cls = resolve(info.architectures)
    model_dir, hf_config = info.model_dir, info.hf_config
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_len = info.max_model_len
    model = _build(lambda: cls(hf_config, backend, max_len), device, dtype)
    scheme = scheme_of(hf_config)
    if scheme is not None and config.quantization:
        raise ValueError(f"{info.model_id} is quantized already: leave --quantization unset")
    if config.load_format == "dummy":
        init_dummy(model, config.seed)
    elif scheme is not None:
        weights, grids = read_grids(iter_weights(model_dir), scheme)
        model.load_weights(weights)
        apply_grids(model, grids)
    else:
        model.load_weights(iter_weights(model_dir))
    if config.quantization:
        quantize_linears(model, config.quantization)
    if scheme is not None or config.quantization:
        gc.collect()  # the full-precision weights the quantized ones replaced
        return_freed_memory()
    return LoadedModel(model.eval(), info, device, dtype)


def load_vision_encoder(config: EngineConfig) -> LoadedModel:
    """Only the vision tower + projector (the encoder service's model): the model class's
    ``encoder_class``, with ``encode_images`` as the whole model has it."""
    info = ModelInfo.load(config)
    if not info.vision:
        raise ValueError(f"model {info.model_id!r} has no vision tower")
    cls = resolve(info.architectures).encoder_class
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    encoder = _build(lambda: cls(info.hf_config), device, dtype)
    if config.load_format == "dummy":
        init_dummy(encoder, config.seed)
    else:
        wanted = cls.weight_prefixes
        encoder.load_weights(
            dict(iter_weights(info.model_dir, keep=lambda n: any(w in n for w in wanted)))
        )
    return LoadedModel(encoder.eval(), info, device, dtype)


def _build(make, device: torch.device, dtype: torch.dtype) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)
