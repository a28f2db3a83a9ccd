"""A model's linear layers with quantized weights (``--quantization``; the kernels and the
weight format are in services/kernels/quant.py).

Which layers: every ``nn.Linear`` of the text decoder (``language_model`` where a
multimodal model wraps one) and every expert's matrices of its mixture-of-experts layers,
but the LM head and a mixture-of-experts router. The head
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
from services.models.moe import ExpertDispatch

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
    of their weights, and each mixture-of-experts layer's experts by theirs, in place;
    returns how many linears (an expert's matrix counting one) were replaced."""
    decoder = text_decoder(model)
    targets = [
        (name, m)
        for name, m in decoder.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in _KEEP
    ]
    before = after = count = 0
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = decoder.get_submodule(parent_name) if parent_name else decoder
        q = quantize(linear.weight, method)
        before += linear.weight.numel() * linear.weight.element_size()
        after += q.nbytes
        count += 1
        setattr(parent, attr, QuantLinear(q, linear.bias))
    for moe in [m for m in decoder.modules() if isinstance(m, ExpertDispatch)]:
        b, a, n = quantize_experts(moe, method)
        before, after, count = before + b, after + a, count + n
    log.info(
        "quantized %d linears to %s: %.1f MiB of weights -> %.1f MiB",
        count,
        method,
        before / 2**20,
        after / 2**20,
    )
    return count


def quantize_experts(moe: ExpertDispatch, method: str) -> tuple[int, int, int]:
    """Each expert's matrices as ``QuantLinear``s in ``moe.quantized``; the stacked
    full-precision weights are dropped. Returns (bytes before, bytes after, matrices).
    An expert's matrix is quantized alone, as a dense linear is: int8 a scale per output
    row, int4 groups along its inputs."""
    stacks = moe.expert_weights()
    per_expert = zip(*(s.unbind(0) for s in stacks), strict=True)
    moe.quantized = nn.ModuleList(
        nn.ModuleList(QuantLinear(quantize(w, method), None) for w in mats) for mats in per_expert
    )
    before = sum(s.numel() * s.element_size() for s in stacks)
    for name, p in list(moe.named_parameters(recurse=False)):
        if any(p is s for s in stacks):
            setattr(moe, name, nn.Parameter(p.new_empty(0), requires_grad=False))
    moe.views = None
    after = sum(t.numel() * t.element_size() for t in moe.quantized.buffers())
    return before, after, len(moe.quantized) * len(stacks)
