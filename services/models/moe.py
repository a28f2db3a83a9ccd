"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, Llama-family layers whose MLP is
a router and a set of gated experts (``MoEMLP``).

A step's tokens are grouped by the experts the router picks, and each expert chosen by
any token runs once over its tokens (on CUDA, every pair in one grouped-GEMM launch,
services/kernels/triton_moe.py): its weights are read once a step, and at batch 1
only the k chosen experts' weights are read at all. The loop is over experts, in
ascending order as transformers' is (so each token's sum adds the same terms in the same
order), never over tokens.

Checkpoints store experts one by one (``experts.<e>.gate_proj`` / ``up_proj`` /
``down_proj``; Mixtral's ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``); they load
into one [E, 2I, H] and one [E, H, I] tensor a layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels.backend import Backend
from services.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from services.models.loader import CheckpointError, copy_param

# layer, expert, projection (checkpoint's name) of a per-expert weight
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# projection -> (our tensor, shard): gate and up stack into gate_up
_PROJ = {
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", None),
    "w1": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "w2": ("down", None),
}


class ExpertDispatch(nn.Module):
    """Runs each token's ``top_k`` experts and sums their outputs by weight: the
    grouping both MoE layer kinds share. A subclass gives ``expert_weights`` ([E, ...]
    tensors, one slice an expert) and ``expert`` (one expert's forward on its rows)."""

    def __init__(self, backend: Backend, top_k: int):
        super().__init__()
        self.backend, self.top_k = backend, top_k
        # Each expert's weight slices as views made once: the CPU GEMM keeps a packed
        # copy per weight tensor object, and a fresh view per call would repack it.
        self.views: list[tuple[torch.Tensor, ...]] | None = None
        # With --quantization: per expert, one QuantLinear per matrix of expert_weights()
        # (services/models/quantize.py quantize_experts), which then hold nothing.
        self.quantized: nn.ModuleList | None = None

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def expert(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """sum over k of weights[t, k] * expert[experts[t, k]](h[t]), per token t."""
        if self.views is None:
            self.views = (
                [tuple(q.weight for q in mats) for mats in self.quantized]
                if self.quantized is not None
                else list(zip(*(w.unbind(0) for w in self.expert_weights()), strict=True))
            )
        weights = weights.flatten()
        out = torch.zeros_like(h)
        if h.shape[0] == 1:  # batch-1 decode: the token's k experts, ascending, no grouping
            picks = sorted(zip(experts[0].tolist(), range(self.top_k), strict=True))
            for e, slot in picks:
                out += self.expert(h, *self.views[e]) * weights[slot : slot + 1, None]
            return out
        # Group the (token, slot) pairs by expert, ascending; stable keeps token order.
        order = torch.argsort(experts.flatten(), stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.views)).tolist()
        tokens = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs, rows = order[start : start + n], tokens[start : start + n]
            start += n
            out.index_add_(0, rows, self.expert(h[rows], *self.views[e]) * weights[pairs, None])
        return out


class MoEMLP(ExpertDispatch):
    """Top-k router + gated experts. ``normalize``: the k chosen probabilities rescaled
    to sum to 1 (Mixtral always; Qwen3-MoE when ``norm_topk_prob``)."""

    def __init__(self, cfg, backend: Backend, num_experts: int, inter: int, normalize: bool):
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise CheckpointError(f"unsupported activation {cfg.hidden_act!r}")
        super().__init__(backend, cfg.num_experts_per_tok)
        self.normalize = normalize
        self.inter = inter
        if not 0 < self.top_k <= num_experts:
            raise CheckpointError(f"{self.top_k} experts per token of {num_experts}")
        self.gate = nn.Linear(cfg.hidden_size, num_experts, bias=False)
        # [E, out, in] with each expert's matrix column-major (W^T contiguous), as dense
        # layers keep theirs (weight_layout.py): the native GEMV reads it 1.5-1.8x faster
        # at 1-8 rows than row-major.
        self.gate_up = nn.Parameter(column_major(num_experts, 2 * inter, cfg.hidden_size))
        self.down = nn.Parameter(column_major(num_experts, cfg.hidden_size, inter))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.backend.linear(h, self.gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        if self.backend.name == "triton" and self.quantized is None:
            return self._grouped(h, experts, weights.flatten())
        return self.combine(h, experts, weights)

    def _grouped(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """Every (token, expert) pair in two grouped GEMM launches (CUDA, triton_moe.py)."""
        from services.kernels.triton_moe import align_by_expert, grouped_gemm

        rows, blocks, pairs = align_by_expert(experts, self.gate_up.shape[0])
        gate, up = grouped_gemm(h, self.gate_up, rows, blocks).split(self.inter, dim=-1)
        slots = torch.arange(rows.numel(), device=h.device)
        y = grouped_gemm(F.silu(gate) * up, self.down, torch.where(rows >= 0, slots, -1), blocks)
        valid = pairs >= 0
        out = torch.zeros_like(h)
        out.index_add_(0, rows[valid], y[valid] * weights[pairs[valid], None])
        return out

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up, self.down

    def expert(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
        gate, up = self.backend.linear(x, gate_up).split(self.inter, dim=-1)
        return self.backend.linear(F.silu(gate) * up, down)

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> str:
        """One expert's projection; returns its key for the completeness check."""
        target, shard = _PROJ[proj]
        self.views = None
        param = getattr(self, target)[expert]
        if shard is not None:
            param = param.narrow(0, shard * self.inter, self.inter)
        copy_param(param, tensor, name)
        return f"{target}.{expert}.{shard}"

    def expected_keys(self) -> set[str]:
        n = self.gate_up.shape[0]
        return {f"gate_up.{e}.{s}" for e in range(n) for s in (0, 1)} | {
            f"down.{e}.None" for e in range(n)
        }


def column_major(experts: int, rows: int, cols: int) -> torch.Tensor:
    """[experts, rows, cols] whose every [rows, cols] slice has strides (1, rows)."""
    return torch.empty(experts, cols, rows).transpose(1, 2)


class _MoEWeights:
    """Loading shared by the MoE decoders: expert tensors into their layer's MoEMLP, the
    rest as the Llama family loads it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: dict[int, set[str]] = {}
        rest = []
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = _EXPERT.match(name)
            if m is None:
                rest.append((name, tensor))
                continue
            layer, expert, proj = int(m[1]), int(m[2]), m[3]
            mlp = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
            if not isinstance(mlp, MoEMLP) or proj not in _PROJ or expert >= mlp.gate_up.shape[0]:
                raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
            seen.setdefault(layer, set()).add(mlp.load_expert(expert, proj, tensor, name))
        super().load_weights(rest)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoEMLP):
                missing = layer.mlp.expected_keys() - seen.get(i, set())
                if missing:
                    raise CheckpointError(
                        f"layer {i}: expert weights missing from the checkpoint: "
                        f"{sorted(missing)[:4]}"
                    )

    def _check_complete(self, params: dict, seen: set[str]) -> None:
        dense = {n: p for n, p in params.items() if not n.endswith((".gate_up", ".down"))}
        super()._check_complete(dense, seen)


class Qwen3MoeForCausalLM(_MoEWeights, Qwen3ForCausalLM):
    """Qwen3 layers; a layer is sparse unless listed in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th one."""

    def mlp_factory(self, cfg, backend: Backend):
        step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())

        def make(i: int):
            if i in dense or cfg.num_experts == 0 or (i + 1) % step:
                return None
            args = (cfg.num_experts, cfg.moe_intermediate_size, bool(cfg.norm_topk_prob))
            return MoEMLP(cfg, backend, *args)

        return make


class MixtralForCausalLM(_MoEWeights, LlamaForCausalLM):
    def mlp_factory(self, cfg, backend: Backend):
        args = (cfg.num_local_experts, cfg.intermediate_size, True)
        return lambda i: MoEMLP(cfg, backend, *args)
