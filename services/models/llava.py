"""LLaVA: a CLIP or SigLIP vision tower + projector in front of a Llama-family decoder.

The vision tower and projector are transformers' own modules (DESIGN allows it); the
decoder is ours, on the paged KV cache. Image embeddings replace the rows of the
``<image>`` placeholder tokens, exactly as transformers' masked scatter does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from services.kernels.backend import Backend
from services.models import config_json
from services.models.gemma3 import Gemma3ForCausalLM
from services.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from services.models.loader import CheckpointError, load_into
from services.models.wrapped_decoder import WrapsDecoder

TEXT_MODELS = {
    "gemma3_text": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

_LM_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def image_token_id(cfg) -> int:
    tid = getattr(cfg, "image_token_id", None)
    return int(tid if tid is not None else cfg.image_token_index)


def tokens_per_image(cfg) -> int:
    """Embedding rows per image (the rule lives in config_json, shared with the gateway)."""
    return config_json.tokens_per_image(cfg.to_dict())


class VisionEncoder(nn.Module):
    """Vision tower + projector: pixel values -> one embedding row per image token."""

    # The checkpoint's weights this part loads (the encoder service loads only these).
    weight_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)
        self.feature_layer = cfg.vision_feature_layer
        self.strategy = cfg.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}")

    @property
    def tokens_per_image(self) -> int:
        return tokens_per_image(self.config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens_per_image, text hidden]."""
        dtype = next(self.vision_tower.parameters()).dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True)
        layers = (
            self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]
        )
        feats = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(torch.cat(feats, dim=-1))

    def encode_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's output -> one embedding [tokens, hidden] per image."""
        return list(self(inputs["pixel_values"]))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        vision = {
            _strip(n, _VISION_PREFIXES): t for n, t in weights.items() if _has(n, _VISION_PREFIXES)
        }
        own = set(self.vision_tower.state_dict())
        vision = {_vision_name(n, own): t for n, t in vision.items()}
        proj = {
            _strip(n, _PROJECTOR_PREFIXES): t
            for n, t in weights.items()
            if _has(n, _PROJECTOR_PREFIXES)
        }
        load_into(self.vision_tower, vision, "vision_tower")
        load_into(self.multi_modal_projector, proj, "multi_modal_projector")


class LlavaForConditionalGeneration(WrapsDecoder, nn.Module):
    """Decoder interface of ``LlamaForCausalLM`` plus ``encode_images``."""

    encoder_class = VisionEncoder

    def __init__(self, cfg, backend: Backend, max_positions: int):
        super().__init__()
        self.config = cfg
        text_type = cfg.text_config.model_type
        if text_type not in TEXT_MODELS:
            raise ValueError(f"LLaVA with a {text_type!r} decoder is not supported")
        self.language_model = TEXT_MODELS[text_type](cfg.text_config, backend, max_positions)
        self.vision = self.encoder_class(cfg)
        self.image_token_id = image_token_id(cfg)
        self.num_kv_heads = self.language_model.num_kv_heads
        self.head_dim = self.language_model.head_dim

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image

    def encode_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.vision.encode_images(inputs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The placeholder id may lie past the decoder's vocabulary; its rows are replaced.
        vocab = self.language_model.model.embed_tokens.num_embeddings
        return self.language_model.embed(input_ids.clamp(max=vocab - 1))

    # The language model hands a draft head its layers' outputs (speculative decoding).
    supports_aux_hidden = True

    def forward(self, positions, inputs_embeds, kv_caches, meta, keep=None, aux_layers=()):
        """The language model's hidden states (with ``aux_layers``: (hidden, aux))."""
        return self.language_model(positions, inputs_embeds, kv_caches, meta, keep, aux_layers)

    def decode_greedy(self, tokens, positions, kv_caches, meta, steps: int):
        return self.language_model.decode_greedy(tokens, positions, kv_caches, meta, steps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = dict(weights)
        text = []
        for name, tensor in weights.items():
            for old, new in _LM_PREFIXES:
                if name.startswith(old):
                    text.append((new + name[len(old) :], tensor))
                    break
            else:
                if not _has(name, _VISION_PREFIXES + _PROJECTOR_PREFIXES):
                    raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
        self.language_model.load_weights(text)
        self.vision.load_weights(weights)


def _has(name: str, prefixes: tuple[str, ...]) -> bool:
    return name.startswith(prefixes)


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if name.startswith(p):
            return name[len(p) :]
    return name


def _vision_name(name: str, own: set[str]) -> str:
    """Checkpoints name the tower with or without its inner ``vision_model.`` prefix."""
    if name in own:
        return name
    if name.startswith("vision_model.") and name[len("vision_model.") :] in own:
        return name[len("vision_model.") :]
    if f"vision_model.{name}" in own:
        return f"vision_model.{name}"
    return name
