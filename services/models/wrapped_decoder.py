"""What a multimodal model hands straight to the decoder it wraps as ``language_model``."""

from __future__ import annotations

import torch


class WrapsDecoder:
    """The LM-head calls of the engine's model interface, answered by ``language_model``."""

    language_model: torch.nn.Module

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.pair_logits(hidden, token_ids)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.greedy_tokens(hidden)
