"""Validated configuration objects, filled from CLI flags and ``EPD_*`` variables.

Nothing deeper in the code reads the environment: services build these objects once at
start-up (STYLE.md 8).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


def _coerce(raw: str, kind: Any) -> Any:
    text = str(kind)
    if "bool" in text:
        return raw.strip().lower() in _TRUE
    if "int" in text and "None" in text and raw.strip().lower() in ("", "none"):
        return None
    if text.startswith("int") or "int |" in text:
        return int(raw)
    if text.startswith("float") or "float |" in text:
        return float(raw)
    return raw


def env_overrides(cls: type, prefix: str = "EPD_", environ=None) -> dict[str, Any]:
    """Values for ``cls``'s fields found as ``EPD_<FIELD>`` in the environment."""
    environ = os.environ if environ is None else environ
    out = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name.upper()
        if key in environ:
            out[f.name] = _coerce(environ[key], f.type)
    return out


@dataclass
class EngineConfig:
    """Everything the inference engine needs: model, KV cache, scheduler, backend."""

    # Checkpoint directory (Hugging Face layout) or "demo" for the built-in tiny VLM.
    model: str = "demo"
    # Where the demo checkpoint is generated on first use.
    demo_dir: str = field(default_factory=lambda: os.path.expanduser("~/.cache/epd-serve/demo"))
    # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "bfloat16" or "float16".
    dtype: str = "auto"
    # "auto" (CUDA when present), "cpu" or "cuda[:N]".
    device: str = "auto"
    # "auto" reads safetensors; "dummy" builds the architecture with random weights.
    load_format: str = "auto"
    # Context length; default is the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # Tokens per KV block.
    block_size: int = 16
    # Memory budget of the KV pool in MiB (ignored when num_kv_blocks is set).
    kv_cache_memory_mb: int = 512
    # Exact number of KV blocks (tests and benchmarks use it).
    num_kv_blocks: int | None = None
    # Token budget of one engine step (prefill chunks + decode tokens).
    max_num_batched_tokens: int = 8192
    # Most requests in one step.
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton".
    attention_backend: str = "auto"
    # Seed for dummy weights and for requests that bring no seed of their own.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.kv_cache_memory_mb <= 0:
            raise ValueError("kv_cache_memory_mb must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """Defaults < ``EPD_*`` variables < explicit overrides (CLI flags)."""
        values = env_overrides(cls)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
