"""What every process must agree on about a checkpoint, read from its ``config.json``
without transformers' config classes (they import torch; the gateway must not).

A saved config may leave out values equal to the class defaults, so each supported
model type's defaults are listed here; tests/unit/test_config_json.py holds them equal to
transformers' own classes, and every value read here equal to what AutoConfig gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.models.checkpoint import CheckpointError

# The ``architectures`` names services/models/registry.py implements.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "LlavaForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "NemotronHForCausalLM",
    }
)

_TEXT_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "vocab_size": 32000, "eos_token_id": 2},
    "mistral": {
        "max_position_embeddings": 131072,
        "vocab_size": 32000,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": {"max_position_embeddings": 32768, "vocab_size": 151936, "use_sliding_window": False},
    "qwen3": {"max_position_embeddings": 32768, "vocab_size": 151936, "use_sliding_window": False},
    "qwen2_5_vl_text": {
        "max_position_embeddings": 32768,
        "vocab_size": 152064,
        "use_sliding_window": False,
        "eos_token_id": 151645,
    },
    "qwen3_vl_text": {"max_position_embeddings": 128000, "vocab_size": 151936},
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "use_sliding_window": False,
    },
    "mixtral": {"max_position_embeddings": 131072, "vocab_size": 32000, "eos_token_id": 2},
    "nemotron_h": {"max_position_embeddings": 4096, "vocab_size": 131072, "eos_token_id": 2},
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "vocab_size": 262208,
        "sliding_window": 4096,
        "eos_token_id": 1,
    },
}
_VISION_DEFAULTS = {
    "clip_vision_model": {"image_size": 224, "patch_size": 32},
    "siglip_vision_model": {"image_size": 224, "patch_size": 16},
}
_LLAVA_DEFAULTS = {"image_token_index": 32000, "vision_feature_select_strategy": "default"}
# A llava config's sub-configs name their model type, or get these.
_LLAVA_SUB_TYPES = {"text_config": "llama", "vision_config": "clip_vision_model"}
_QWEN_VL_DEFAULTS = {"image_token_id": 151655}
# Gemma 3: image token, tokens per image, and the tokens that open and close an image.
_GEMMA3_DEFAULTS = {
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
}
# Qwen-VL model types (their image token counts follow the image) -> the decoder's type.
QWEN_VL_TEXT_TYPES = {"qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text"}


# Decoders whose sliding-window layers apply the window themselves; for the others a
# window caps the context (services/models/info.py max_model_len).
_OWN_WINDOWS = frozenset({"gemma3_text"})


# Nemotron-H's layer kinds by every name they go by: transformers' current ones, its
# legacy ones, and the letters of ``hybrid_override_pattern``.
_HYBRID_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "M": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}


def hybrid_layer_kinds(types: list[str] | None, pattern: str | None) -> list[str]:
    """Each layer's mixer (mamba, attention, mlp or moe) from ``layers_block_type`` or
    the older ``hybrid_override_pattern``; CheckpointError for a kind we do not run."""
    kinds = list(types or pattern or [])
    unknown = sorted({str(k) for k in kinds if k not in _HYBRID_KINDS})
    if unknown or not kinds:
        raise CheckpointError(
            f"layers_block_type names layer kinds we do not run: {unknown or kinds}; "
            f"known: {sorted(_HYBRID_KINDS)}"
        )
    return [_HYBRID_KINDS[k] for k in kinds]


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture has no implementation here."""


@dataclass(frozen=True)
class ConfigFacts:
    architectures: list[str]
    max_position_embeddings: int
    sliding_window: int | None  # a window the engine applies by capping the context
    vocab_size: int
    eos_token_id: int | list[int] | None
    image_token_id: int | None  # None: no vision
    tokens_per_image: int  # 0: it depends on the image (services/models/image_grid.py)
    model_type: str = ""
    # (begin, end) token ids around an image's tokens, where the chat template writes
    # only the begin token and the processor adds the rest (Gemma 3); else None.
    image_boundary: tuple[int, int] | None = None


def read_facts(cfg: dict) -> ConfigFacts:
    """The facts of a parsed config.json; CheckpointError for an unsupported model."""
    archs = list(cfg.get("architectures") or [])
    if not SUPPORTED_ARCHITECTURES.intersection(archs):
        raise UnsupportedModelError(
            f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    kind = cfg.get("model_type", "")
    image_id, per_image, boundary = None, 0, None
    if kind == "gemma3":
        top = {**_GEMMA3_DEFAULTS, **cfg}
        sub = {"model_type": "gemma3_text", **(cfg.get("text_config") or {})}
        text = _with_defaults(sub, _TEXT_DEFAULTS, "text")
        image_id, per_image = int(top["image_token_index"]), int(top["mm_tokens_per_image"])
        boundary = (int(top["boi_token_index"]), int(top["eoi_token_index"]))
    elif kind in QWEN_VL_TEXT_TYPES:
        # transformers 5 nests the decoder's fields; earlier checkpoints keep them on top.
        text = {**cfg, **(cfg.get("text_config") or {}), "model_type": QWEN_VL_TEXT_TYPES[kind]}
        text = _with_defaults(text, _TEXT_DEFAULTS, "text")
        image_id = int({**_QWEN_VL_DEFAULTS, **cfg}["image_token_id"])
    elif kind == "llava" or "vision_config" in cfg:
        top = _llava(cfg)
        text = _with_defaults(top["text_config"], _TEXT_DEFAULTS, "text")
        tid = top.get("image_token_id")
        image_id = int(tid if tid is not None else top["image_token_index"])
        per_image = tokens_per_image(cfg)
    else:
        text = _with_defaults(cfg, _TEXT_DEFAULTS, "text")
    if kind == "nemotron_h":  # before transformers reads the config (its error is vaguer)
        hybrid_layer_kinds(cfg.get("layers_block_type"), cfg.get("hybrid_override_pattern"))
    window = text.get("sliding_window")
    if not text.get("use_sliding_window", True) or text["model_type"] in _OWN_WINDOWS:
        window = None
    return ConfigFacts(
        archs,
        int(text["max_position_embeddings"] or 2048),
        window,
        int(text["vocab_size"]),
        text.get("eos_token_id"),
        image_id,
        per_image,
        kind,
        boundary,
    )


def _llava(cfg: dict) -> dict:
    top = {**_LLAVA_DEFAULTS, **cfg}
    for key, kind in _LLAVA_SUB_TYPES.items():
        top[key] = {"model_type": kind, **(cfg.get(key) or {})}
    return top


def _with_defaults(sub: dict, table: dict, what: str) -> dict:
    kind = sub.get("model_type")
    if kind not in table:
        raise CheckpointError(f"unsupported {what} model type {kind!r}; supported: {sorted(table)}")
    return {**table[kind], **sub}


def tokens_per_image(llava_config: dict) -> int:
    """Embedding rows per image: patches (+ CLS for CLIP), minus CLS under "default"."""
    top = _llava(llava_config)
    vc = _with_defaults(top["vision_config"], _VISION_DEFAULTS, "vision")
    n = (vc["image_size"] // vc["patch_size"]) ** 2
    if vc["model_type"].startswith("clip"):
        n += 1
    return n - 1 if top["vision_feature_select_strategy"] == "default" else n
