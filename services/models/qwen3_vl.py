"""Qwen3-VL: Qwen2.5-VL's shape (services/models/qwen2_5_vl.py) with a Qwen3 decoder,
interleaved M-RoPE frequencies, a plain ViT (learned positions resampled to each image,
no windows) and DeepStack: features taken from some tower blocks are added to the
decoder's residual stream at the image's rows after its first layers.

An image's embedding is the main features and then each DeepStack feature, side by
side ([tokens, hidden * (1 + L)]): one tensor, so the embedding cache, the bus and
chunked prefill carry it as they carry any other; the runner puts the first ``hidden``
columns in the input and hands the rest to the decoder as ``layer_adds``.
"""

from __future__ import annotations

import torch
from torch import nn

from services.kernels.backend import Backend
from services.models.llama import Qwen3ForCausalLM
from services.models.loader import CheckpointError
from services.models.qwen2_5_vl import Qwen2_5_VisionEncoder, Qwen2_5_VLForConditionalGeneration


class Qwen3VisionEncoder(Qwen2_5_VisionEncoder):
    """The tower, its merger and DeepStack mergers: patches -> [tokens, hidden * (1 + L)]."""

    def _build(self, vision_config) -> nn.Module:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel._from_config(vision_config)

    def _features(self, out) -> torch.Tensor:
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    encoder_class = Qwen3VisionEncoder
    decoder_class = Qwen3ForCausalLM
    mrope_interleaved = True

    def __init__(self, cfg, backend: Backend, max_positions: int):
        super().__init__(cfg, backend, max_positions)
        deep = len(cfg.vision_config.deepstack_visual_indexes)
        if deep >= cfg.text_config.num_hidden_layers:
            raise CheckpointError(
                f"{deep} DeepStack features for a {cfg.text_config.num_hidden_layers}-layer decoder"
            )
        # Columns of an image's embedding (see LoadedModel.image_embedding_width).
        self.image_embedding_width = cfg.text_config.hidden_size * (1 + deep)
