"""What a checkpoint is, without its weights: what the gateway and every service agree on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from services.config import EngineConfig
from services.models.checkpoint import CheckpointError, read_json
from services.models.config_json import ConfigFacts, read_facts
from services.models.demo import ensure_demo_model
from services.models.fingerprint import checkpoint_fingerprint
from services.models.image_grid import ImageGrid, read_grid

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
    """Same checkpoint (content, not path) and preprocessing -> same fingerprint on every
    host; other weights of the same shape -> another (services/models/fingerprint.py)."""
    extra = f"{config.load_format}:{config.seed if config.load_format == 'dummy' else ''}"
    return checkpoint_fingerprint(model_dir, extra)


def max_model_len(facts: ConfigFacts, config: EngineConfig) -> int:
    limit = facts.max_position_embeddings
    window = facts.sliding_window
    if window and window < limit:
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
    """Read from the checkpoint's JSON files alone (no torch): the gateway loads it too.
    ``hf_config`` / ``text_config`` (transformers' objects) load on first use, in the
    processes that build the model."""

    model_id: str  # the name clients use ("demo" or the directory's name)
    model_dir: Path
    architectures: list[str]
    max_model_len: int
    fingerprint: str
    vocab_size: int
    image_token_id: int | None
    tokens_per_image: int
    config_eos: int | list[int] | None = None  # eos_token_id of config.json
    model_type: str = ""
    image_boundary: tuple[int, int] | None = None  # see ConfigFacts

    @cached_property
    def image_grid(self) -> ImageGrid | None:
        """Tokens per image from its size (None: a text model)."""
        if not self.vision:
            return None
        return read_grid(self.model_dir, self.model_type, self.tokens_per_image)

    @property
    def vision(self) -> bool:
        return self.image_token_id is not None

    @cached_property
    def hf_config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read the config of {self.model_dir}: {e}") from e

    @property
    def text_config(self):
        return getattr(self.hf_config, "text_config", None) or self.hf_config

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
            eos = self.config_eos
        if eos is None:
            eos = tokenizer_eos
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    @classmethod
    def load(cls, config: EngineConfig) -> ModelInfo:
        model_dir = resolve_model_dir(config)
        facts = read_facts(read_json(model_dir / "config.json"))
        model_id = "demo" if config.model == "demo" else model_dir.name
        return cls(
            model_id,
            model_dir,
            facts.architectures,
            max_model_len(facts, config),
            fingerprint(model_dir, config),
            facts.vocab_size,
            facts.image_token_id,
            facts.tokens_per_image,
            facts.eos_token_id,
            facts.model_type,
            facts.image_boundary,
        )
