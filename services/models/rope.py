"""Rotary position tables, computed the way transformers computes them.

Using transformers' own rope-init functions for scaled variants (linear, llama3, yarn,
longrope, ...) keeps our cos/sin bit-identical to the reference for every rope type.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config) -> dict:
    """transformers >= 5 keeps them in ``rope_parameters``; older configs in two fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inv_freq_and_scaling(
    config, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """``layer_type``: the parameters of one kind of layer, where a model gives each kind
    its own (Gemma 3: ``sliding_attention`` and ``full_attention``)."""
    params = rope_parameters(config)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    # "dynamic" rescales with the running length in transformers; here its table is fixed.
    kw = {"layer_type": layer_type} if layer_type is not None else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kw)
    return inv, float(scaling)


def cos_sin_cache(
    config, head_dim: int, max_positions: int, layer_type: str | None = None
) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos(pos * inv_freq) then sin, both times scaling."""
    inv_freq, scaling = inv_freq_and_scaling(config, head_dim, layer_type)
    pos = torch.arange(max_positions, dtype=torch.float)
    inv_freq = inv_freq.to(pos.device)  # scaled rope types compute it on the CPU
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
