"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP tower whose
patches are average-pooled to ``mm_tokens_per_image`` tokens, normed and projected, in
front of the Gemma 3 decoder (gemma3.py), laid out as LLaVA's (llava.py).

An image's tokens see each other both ways (bidirectional attention inside the image,
causal everywhere else): the runner gives the decoder each row's last visible position
and the scheduler never ends a prefill chunk inside an image (``bidirectional_images``).
The chat template writes ``<start_of_image>``; the input processor spells it out as
the processor does (ConfigFacts.image_boundary).
"""

from __future__ import annotations

import torch
from transformers import AutoModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from services.models.llava import LlavaForConditionalGeneration, VisionEncoder


class Gemma3VisionEncoder(VisionEncoder):
    """SigLIP + Gemma 3's pooling projector: [N, C, H, W] -> [N, tokens, text hidden]."""

    def __init__(self, cfg):
        torch.nn.Module.__init__(self)
        self.config = cfg
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    @property
    def tokens_per_image(self) -> int:
        return int(self.config.mm_tokens_per_image)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vision_tower.parameters()).dtype
        hidden = self.vision_tower(pixel_values.to(dtype)).last_hidden_state
        return self.multi_modal_projector(hidden)


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    encoder_class = Gemma3VisionEncoder
    bidirectional_images = True
    supports_aux_hidden = False

    def forward(
        self, positions, inputs_embeds, kv_caches, meta, keep=None, aux_layers=(), last_seen=None
    ):
        return self.language_model(
            positions, inputs_embeds, kv_caches, meta, keep, aux_layers, last_seen
        )
