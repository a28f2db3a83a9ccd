"""A model's linear layers with quantized weights (``--quantization``; the kernels and the
weight format are in services/kernels/quant.py).

Which layers: every ``nn.Linear`` of the text decoder (``language_model`` where a
multimodal model wraps one), but the LM head and a mixture-of-experts router. The head
picks the token, a router the experts: both small next to the layers and sensitive to
rounding, and vLLM's and llm-compressor's recipes keep them in full precision too. A
vision tower stays as it is: the encoder service computes the same image embeddings for
every decoder, and the embedding cache is shared between them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels.quant import QuantizedWeight, quantize

log = logging.getLogger(__name__)

# Linear names kept in full precision (see the module docstring).
_KEEP = ("lm_head", "gate")


class QuantLinear(nn.Module):
    """A linear layer whose ``weight`` is a ``QuantizedWeight``: the layers hand it to
    ``Backend.linear`` as they hand an fp32 one. The codes and scales are buffers, so the
    module moves between devices like any other."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.method, self.shape, self.group = weight.method, weight.shape, weight.group
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("offset", weight.offset)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(
            self.method, self.shape, self.codes, self.scale, self.offset, self.group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(x.dtype), self.bias)


def text_decoder(model: nn.Module) -> nn.Module:
    """The part of a model that generates text: its ``language_model``, or itself."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the text decoder's linears (see the module docstring) by ``QuantLinear``s
    of their weights, in place; returns how many were replaced."""
    decoder = text_decoder(model)
    targets = [
        (name, m)
        for name, m in decoder.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in _KEEP
    ]
    before = after = 0
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = decoder.get_submodule(parent_name) if parent_name else decoder
        q = quantize(linear.weight, method)
        before += linear.weight.numel() * linear.weight.element_size()
        after += q.nbytes
        setattr(parent, attr, QuantLinear(q, linear.bias))
    log.info(
        "quantized %d linears to %s: %.1f MiB of weights -> %.1f MiB",
        len(targets),
        method,
        before / 2**20,
        after / 2**20,
    )
    return len(targets)
