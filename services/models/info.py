"""What a checkpoint is, without its weights: what the gateway and every service agree on."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from services.config import EngineConfig
from services.models.checkpoint import CheckpointError, read_json
from services.models.demo import ensure_demo_model

log = logging.getLogger(__name__)


def resolve_model_dir(config: EngineConfig) -> Path:
    if config.model == "demo":
        return ensure_demo_model(config.demo_dir)
    path = Path(config.model).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"model {config.model!r} is not a checkpoint directory (no config.json)"
        )
    return path


def fingerprint(model_dir: Path, config: EngineConfig) -> str:
    """Same checkpoint and preprocessing -> same fingerprint on every host."""
    h = hashlib.sha256()
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        if (model_dir / name).exists():
            h.update((model_dir / name).read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(
        f"{config.load_format}:{config.seed if config.load_format == 'dummy' else ''}".encode()
    )
    return h.hexdigest()[:16]


def max_model_len(text_config, config: EngineConfig) -> int:
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


@dataclass
class ModelInfo:
    model_id: str  # the name clients use ("demo" or the directory's name)
    model_dir: Path
    architectures: list[str]
    hf_config: object
    text_config: object
    max_model_len: int
    fingerprint: str
    vocab_size: int
    image_token_id: int | None
    tokens_per_image: int

    @property
    def vision(self) -> bool:
        return self.image_token_id is not None

    @property
    def generation_config(self) -> dict:
        """The checkpoint's ``generation_config.json`` (empty when there is none)."""
        path = self.model_dir / "generation_config.json"
        return read_json(path) if path.exists() else {}

    def default_sampling(self) -> dict:
        """SamplingParams defaults from ``generation_config.json`` (what a request that
        leaves a field unset gets, as in vLLM)."""
        gen = self.generation_config
        keys = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
        values = {k: gen[k] for k in keys if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        return values

    def eos_token_ids(self, tokenizer_eos: int | None = None) -> tuple[int, ...]:
        """What ends generation, as transformers decides: generation config, then the
        model config, then the tokenizer."""
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            eos = getattr(self.text_config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer_eos
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    @classmethod
    def load(cls, config: EngineConfig) -> ModelInfo:
        from transformers import AutoConfig

        model_dir = resolve_model_dir(config)
        archs = read_json(model_dir / "config.json").get("architectures") or []
        from services.models.registry import resolve

        resolve(archs)  # fail early, naming the architecture
        try:
            hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read the config of {model_dir}: {e}") from e
        text_config = getattr(hf_config, "text_config", None) or hf_config
        image_id, tpi = None, 0
        if getattr(hf_config, "vision_config", None) is not None:
            from services.models.llava import image_token_id, tokens_per_image

            image_id, tpi = image_token_id(hf_config), tokens_per_image(hf_config)
        model_id = "demo" if config.model == "demo" else model_dir.name
        return cls(model_id, model_dir, archs, hf_config, text_config,
                   max_model_len(text_config, config), fingerprint(model_dir, config),
                   int(text_config.vocab_size), image_id, tpi)  # fmt: skip
