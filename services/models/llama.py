"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) on the paged KV cache.

The four architectures differ only in flags (qkv bias, per-head q/k RMSNorm); each is a
subclass that sets them, registered by its ``architectures`` name. This file holds the
causal-LM wrapper (hidden states, LM head, weight loading); the decoder stack itself is
in llama_layers.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels.backend import Backend
from services.models.llama_layers import DecoderModel
from services.models.loader import CheckpointError, copy_param
from services.models.rope import cos_sin_cache
from services.models.weight_layout import column_major_linears

# checkpoint projection name -> (fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Text decoder: ``forward`` returns hidden states, ``compute_logits`` the head."""

    qkv_bias = False
    qk_norm = False
    # forward can return the outputs of chosen layers (speculative decoding's draft heads).
    supports_aux_hidden = True

    def __init__(self, cfg, backend: Backend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(
            cfg, backend, self.qkv_bias, self.qk_norm, self.mlp_factory(cfg, backend)
        )
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("rope", cos_sin_cache(cfg, attn.head_dim, max_positions), False)
        column_major_linears(self)

    def mlp_factory(self, cfg, backend: Backend):
        """Layer index -> its feed-forward module (None: dense MLPs everywhere)."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight)  # no module-call overhead

    def forward(self, positions, inputs_embeds, kv_caches, meta, keep=None, aux_layers=()):
        """Hidden states (see DecoderModel.forward; with ``aux_layers``, (hidden, aux))."""
        return self.model(positions, inputs_embeds, kv_caches, meta, self.rope, keep, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.backend.linear(hidden, self._head()).float()

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``compute_logits(hidden[i])[token_ids[i]]`` for each i: only those scores."""
        head = self._head().index_select(0, token_ids.to(hidden.device))
        return (hidden * head.to(hidden.dtype)).sum(dim=-1).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of ``compute_logits(hidden)`` per row, without returning the logits."""
        return self.model.backend.greedy_head(hidden, self._head())

    def decode_greedy(self, tokens, positions, kv_caches, meta, steps: int):
        """``steps`` greedy decode steps from ``tokens`` in one backend call: [steps, B]
        token ids, or None when the backend has no such path (see Backend.decode_greedy)."""
        stack = self.model.native_stack(self.rope)
        if stack is None:
            return None
        return self.model.backend.decode_greedy(
            stack,
            self.model.embed_tokens.weight,
            self._head(),
            tokens,
            positions,
            kv_caches,
            meta,
            steps,
        )

    def _head(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie else self.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF names (``model.layers.0.self_attn.q_proj.weight`` ...) into fused params."""
        self.model.stack = None
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie and name.startswith("lm_head.")):
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
            if shard is None:
                copy_param(params[target], tensor, name)
            else:
                self._load_shard(params[target], target, shard, tensor, name)
            seen.add(f"{target}#{shard}")
        self._check_complete(params, seen)

    def _load_shard(self, param, target, shard, tensor, name) -> None:
        owner = self.get_submodule(target.rsplit(".", 2)[0])
        sizes = owner.shard_sizes
        start = sum(sizes[:shard])
        copy_param(param.narrow(0, start, sizes[shard]), tensor, name)

    def _check_complete(self, params: dict, seen: set[str]) -> None:
        missing = []
        for name in params:
            if "qkv_proj" in name or "gate_up_proj" in name:
                n = 3 if "qkv_proj" in name else 2
                missing += [f"{name}#{i}" for i in range(n) if f"{name}#{i}" not in seen]
            elif f"{name}#None" not in seen:
                missing.append(name)
        if missing:
            raise CheckpointError(f"weights missing from the checkpoint: {missing[:8]}")


def _fused_target(name: str) -> tuple[str, int | None]:
    for ckpt, (fused, shard) in _STACKED.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{fused}."), shard
    return name, None


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
