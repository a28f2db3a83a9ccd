"""Qwen2.5-VL: a windowed ViT with a patch merger in front of a Qwen2 decoder whose
rotary positions follow each image's layout (M-RoPE, services/models/mrope.py).

The number of image tokens depends on the image (services/models/image_grid.py). The
vision tower is transformers' own module; the decoder is ours, on the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from services.kernels.backend import Backend
from services.models.llama import Qwen2ForCausalLM
from services.models.loader import CheckpointError, load_into
from services.models.mrope import section_axes, token_table
from services.models.rope import rope_parameters
from services.models.wrapped_decoder import WrapsDecoder

# Checkpoint names: transformers 5 (model.visual / model.language_model) and earlier
# (visual / model) -> ours.
_VISION_PREFIXES = ("model.visual.", "visual.")
_LM_PREFIXES = (("model.language_model.", "model."), ("lm_head.", "lm_head."), ("model.", "model."))


class Qwen2_5_VisionEncoder(nn.Module):
    """The vision tower with its merger: patches -> one row per merged patch (token)."""

    weight_prefixes = ("visual.",)

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.merge = cfg.vision_config.spatial_merge_size
        self.visual = self._build(cfg.vision_config)

    def _build(self, vision_config) -> nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)

    def _features(self, out) -> torch.Tensor:
        """The tower's output -> the embedding rows of every image, in order."""
        return out.pooler_output

    @torch.inference_mode()
    def encode_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's output (``pixel_values`` [patches, C*T*P*P],
        ``image_grid_thw`` [N, 3]) -> one embedding [t*h*w / merge², width] per image."""
        grid = inputs["image_grid_thw"]
        dtype = next(self.visual.parameters()).dtype
        out = self._features(self.visual(inputs["pixel_values"].to(dtype), grid_thw=grid))
        return list(out.split((grid.prod(-1) // self.merge**2).tolist()))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        own = {}
        for name, tensor in weights.items():
            for prefix in _VISION_PREFIXES:
                if name.startswith(prefix):
                    own[name[len(prefix) :]] = tensor
                    break
        load_into(self.visual, own, "visual")


class Qwen2_5_VLForConditionalGeneration(WrapsDecoder, nn.Module):
    """Decoder interface of ``LlamaForCausalLM`` plus ``encode_images``; ``forward``
    takes [3, T] rotary positions (``uses_mrope``) or [T] where every axis agrees."""

    encoder_class = Qwen2_5_VisionEncoder
    decoder_class = Qwen2ForCausalLM
    mrope_interleaved = False  # see section_axes
    uses_mrope = True
    supports_aux_hidden = True

    def __init__(self, cfg, backend: Backend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.language_model = self.decoder_class(cfg.text_config, backend, max_positions)
        self.vision = self.encoder_class(cfg)
        self.image_token_id = int(cfg.image_token_id)
        self.num_kv_heads = self.language_model.num_kv_heads
        self.head_dim = self.language_model.head_dim
        section = rope_parameters(cfg.text_config).get("mrope_section", [16, 24, 24])
        axes = section_axes(section, self.head_dim // 2, self.mrope_interleaved)
        self.register_buffer("axes", axes, False)

    def encode_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.vision.encode_images(inputs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    def forward(
        self, positions, inputs_embeds, kv_caches, meta, keep=None, aux_layers=(), layer_adds=None
    ):
        """``layer_adds``: see DecoderModel.forward (Qwen3-VL's deepstack features)."""
        lm = self.language_model
        rope = lm.rope
        if positions.dim() == 2:  # image tokens in the step: a rotary row per token
            rope = token_table(rope, positions, self.axes)
            positions = torch.arange(positions.shape[1], device=positions.device)
        return lm.model(
            positions, inputs_embeds, kv_caches, meta, rope, keep, aux_layers, layer_adds
        )

    def decode_greedy(self, tokens, positions, kv_caches, meta, steps: int):
        # The native burst places K/V by the rotary position, which M-RoPE shifts.
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = dict(weights)
        text = []
        for name, tensor in weights.items():
            if name.startswith(_VISION_PREFIXES):
                continue
            for old, new in _LM_PREFIXES:
                if name.startswith(old):
                    text.append((new + name[len(old) :], tensor))
                    break
            else:
                raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
        self.language_model.load_weights(text)
        self.vision.load_weights(weights)
