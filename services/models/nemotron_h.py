"""Nemotron-H (``NemotronHForCausalLM``): a hybrid stack of Mamba-2, attention, dense MLP
and mixture-of-experts layers, one mixer per layer, in the order of the config's
``layers_block_type`` (older checkpoints: ``hybrid_override_pattern``, M * - E).

Each layer is a pre-norm residual block around its mixer. Attention layers have no
rotary positions and keep paged KV like every decoder's; Mamba layers keep a recurrent
state per request (mamba2.py). The MoE layer routes by sigmoid scores with a per-expert
correction bias among the best groups of experts, runs non-gated relu² experts in a
latent width when ``moe_latent_size`` is set, and adds a shared expert.

The checkpoint's multi-token-prediction layers (``mtp.*``) are not served: speculative
decoding is refused for hybrid models (services/engine/mamba_state.py says why).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels.backend import Backend
from services.models.config_json import hybrid_layer_kinds
from services.models.llama_layers import Attention, RMSNorm
from services.models.loader import CheckpointError, copy_param
from services.models.mamba2 import Mamba2Mixer
from services.models.moe import ExpertDispatch, column_major

log = logging.getLogger(__name__)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class Relu2MLP(nn.Module):
    def __init__(self, cfg, backend: Backend, inter: int):
        super().__init__()
        if cfg.mlp_hidden_act != "relu2":
            raise CheckpointError(f"unsupported MLP activation {cfg.mlp_hidden_act!r}")
        self.backend = backend
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        be = self.backend
        up = be.linear(h, self.up_proj.weight, self.up_proj.bias)
        return be.linear(relu2(up), self.down_proj.weight, self.down_proj.bias)


class NemotronHMoE(ExpertDispatch):
    """Grouped top-k routing, relu² experts in the latent width, a shared expert."""

    def __init__(self, cfg, backend: Backend):
        experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        if not 0 < k <= experts or experts % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise CheckpointError(
                f"{k} experts a token of {experts} in {cfg.n_group} groups "
                f"({cfg.topk_group} picked)"
            )
        super().__init__(backend, k)
        width = cfg.moe_latent_size or cfg.hidden_size
        inter = cfg.moe_intermediate_size
        self.groups, self.topk_group = cfg.n_group, cfg.topk_group
        self.normalize, self.scale = bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor)
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size))
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.up = nn.Parameter(column_major(experts, inter, width))
        self.down = nn.Parameter(column_major(experts, width, inter))
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.shared_experts = Relu2MLP(cfg, backend, cfg.moe_shared_expert_intermediate_size)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k], weights [T, k]): the best k by corrected score among the
        best ``topk_group`` groups (a group scores its best two), weighted by the
        uncorrected scores."""
        scores = torch.sigmoid(F.linear(h.float(), self.gate.weight.float()))
        corrected = scores + self.gate.e_score_correction_bias.float()
        t, e = corrected.shape
        by_group = corrected.view(t, self.groups, e // self.groups)
        group_scores = by_group.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        corrected = corrected.masked_fill(~keep.repeat_interleave(e // self.groups, 1), -torch.inf)
        experts = corrected.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(h)
        be = self.backend
        x = (
            be.linear(h, self.fc1_latent_proj.weight, self.fc1_latent_proj.bias)
            if self.latent
            else h
        )
        y = self.combine(x, experts, weights.to(x.dtype))
        if self.latent:
            y = be.linear(y, self.fc2_latent_proj.weight, self.fc2_latent_proj.bias)
        return y + self.shared_experts(h)

    def expert(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(relu2(self.backend.linear(x, up)), down)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.up, self.down


class RopelessAttention(Attention):
    rotary = False


class HybridLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg, backend)
        elif kind == "attention":
            self.mixer = RopelessAttention(cfg, backend, qkv_bias=False, qk_norm=False)
        elif kind == "mlp":
            self.mixer = Relu2MLP(cfg, backend, cfg.intermediate_size)
        else:
            self.mixer = NemotronHMoE(cfg, backend)


class NemotronHForCausalLM(nn.Module):
    """``forward`` returns hidden states, ``compute_logits`` the head (as the Llama
    family's); ``state_slots`` names each sequence's Mamba state slot."""

    supports_aux_hidden = False

    def __init__(self, cfg, backend: Backend, max_positions: int):
        super().__init__()
        self.config, self.backend = cfg, backend
        self.kinds = hybrid_layer_kinds(
            getattr(cfg, "layers_block_type", None), getattr(cfg, "hybrid_override_pattern", None)
        )
        if "attention" not in self.kinds:
            raise CheckpointError("a hybrid stack without an attention layer is not served")
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.backbone.layers = nn.ModuleList(HybridLayer(cfg, backend, k) for k in self.kinds)
        self.backbone.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        attn = next(x.mixer for x in self.backbone.layers if x.kind == "attention")
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_kv_layers = self.kinds.count("attention")
        self.num_state_layers = self.kinds.count("mamba")
        mamba = [x.mixer for x in self.backbone.layers if x.kind == "mamba"]
        self.state_shapes = mamba[0].state_shapes() if mamba else None

    def layer_caches(self, kv_layers: list, conv: torch.Tensor, ssm: torch.Tensor) -> list:
        """Per layer, what it keeps: (K, V) of the paged pool for attention, (conv, ssm)
        state tensors [slots, ...] for Mamba, None for the rest."""
        out, kv, state = [], iter(kv_layers), 0
        for kind in self.kinds:
            if kind == "attention":
                out.append(next(kv))
            elif kind == "mamba":
                out.append((conv[state], ssm[state]))
                state += 1
            else:
                out.append(None)
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.backbone.embeddings.weight)

    def forward(self, positions, h, caches, meta, keep=None, state_slots=None):
        if state_slots is None and self.num_state_layers:
            raise ValueError("a hybrid model's step needs each sequence's state slot")
        be, residual = self.backend, None
        for layer, cache in zip(self.backbone.layers, caches, strict=True):
            norm = layer.norm
            if residual is None:
                residual, h = h, be.rms_norm(h, norm.weight, norm.eps)
            else:
                h, residual = be.rms_norm(h, norm.weight, norm.eps, residual)
            if layer.kind == "mamba":
                h = layer.mixer(h, cache, meta.query_lens_cpu, state_slots)
            elif layer.kind == "attention":
                h = layer.mixer(positions, h, cache, meta, None)
            else:
                h = layer.mixer(h)
        norm = self.backbone.norm_f
        h, _ = be.rms_norm(h, norm.weight, norm.eps, residual)
        return h if keep is None else h.index_select(0, keep.rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(hidden, self._head()).float()

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        head = self._head().index_select(0, token_ids.to(hidden.device))
        return (hidden * head.to(hidden.dtype)).sum(dim=-1).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backend.greedy_head(hidden, self._head())

    def decode_greedy(self, *args) -> None:
        return None  # no one-call decode path: the runner loops ordinary steps

    def _head(self) -> torch.Tensor:
        return self.backbone.embeddings.weight if self.tie else self.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters()) | {
            n: b for n, b in self.named_buffers() if n.endswith("e_score_correction_bias")
        }
        seen: set[str] = set()
        skipped = 0
        for name, tensor in weights:
            name = re.sub(r"^model\.", "backbone.", name)
            if name.startswith("mtp."):
                skipped += 1
                continue
            if self.tie and name.startswith("lm_head."):
                continue
            seen.update(self._load_one(params, name, tensor))
        if skipped:
            log.info("%d multi-token-prediction weights not loaded (MTP is not served)", skipped)
        missing = _missing(params, seen)
        if missing:
            raise CheckpointError(f"weights missing from the checkpoint: {missing[:8]}")

    def _load_one(self, params: dict, name: str, tensor: torch.Tensor) -> list[str]:
        m = re.match(r"backbone\.layers\.(\d+)\.mixer\.(.+)$", name)
        layer = int(m[1]) if m else -1
        if m and layer < len(self.kinds) and self.kinds[layer] == "moe":
            moe = self.backbone.layers[layer].mixer
            return moe_weight(moe, f"backbone.layers.{layer}.mixer", m[2], tensor, name)
        proj = re.match(r"(.+)\.([qkv])_proj\.weight$", name)
        if proj:  # q, k and v into the fused qkv_proj
            attn = self.get_submodule(proj[1])
            shard = "qkv".index(proj[2])
            start = sum(attn.shard_sizes[:shard])
            target = f"{proj[1]}.qkv_proj.weight"
            if target not in params:
                raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
            copy_param(params[target].narrow(0, start, attn.shard_sizes[shard]), tensor, name)
            return [f"{target}#{shard}"]
        if name not in params:
            raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
        copy_param(params[name], tensor, name)
        return [name]


def moe_weight(moe: NemotronHMoE, prefix: str, rest: str, tensor, name: str) -> list[str]:
    """One MoE weight: an expert's projection (one by one, or all experts stacked) or
    a plain parameter of the layer. Returns the keys it fills."""
    stacked = re.match(r"experts\.(up|down)_proj(?:\.weight)?$", rest)
    single = re.match(r"experts\.(\d+)\.(up|down)_proj\.weight$", rest)
    if stacked or single:
        which = (stacked or single)[1 if stacked else 2]
        param = moe.up if which == "up" else moe.down
        experts = range(param.shape[0]) if stacked else [int(single[1])]
        if experts[-1] >= param.shape[0]:
            raise CheckpointError(f"expert {experts[-1]} of {param.shape[0]} in {name!r}")
        if stacked:
            copy_param(param, tensor, name)
        else:
            copy_param(param[experts[0]], tensor, name)
        moe.views = None
        return [f"{prefix}.{which}#{e}" for e in experts]
    target = dict(moe.named_parameters()) | dict(moe.named_buffers())
    if rest not in target:
        raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
    copy_param(target[rest], tensor, name)
    return [f"{prefix}.{rest}"]


def _missing(params: dict, seen: set[str]) -> list[str]:
    missing = []
    for name in params:
        m = re.match(r"(backbone\.layers\.\d+\.mixer)\.(up|down)$", name)
        if m:
            n = params[name].shape[0]
            missing += [f"{name}#{e}" for e in range(n) if f"{name}#{e}" not in seen]
        elif name.endswith("qkv_proj.weight"):
            missing += [f"{name}#{s}" for s in range(3) if f"{name}#{s}" not in seen]
        elif name not in seen:
            missing.append(name)
    return missing
