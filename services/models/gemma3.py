"""Gemma 3's decoder (``Gemma3ForCausalLM``) on the paged KV cache.

What differs from the Llama family (llama_layers.py), all read from the config:
- sliding-window layers (``layer_types``: ``sliding_attention`` every few layers, the
  rest ``full_attention``), each kind with its own rotary table;
- four norms a layer (after attention and after the MLP as well as before each), and
  norms that scale by ``1 + weight`` in fp32 (``GemmaNorm``: the 1 added at load);
- the embedding scaled by sqrt(hidden), GELU (tanh) gating, a query scale of
  ``query_pre_attn_scalar`` ** -0.5, and optional final-logit soft-capping.

Sliding-window layers attend through ``torch_backend.masked_attention`` (no native or
Triton kernel takes a window yet), and keep every position's K/V: the block manager
gives a request one block table for all layers (docs/architecture.md, "Not built").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels import torch_backend
from services.kernels.backend import Backend
from services.models.llama import LlamaForCausalLM
from services.models.llama_layers import Attention, KVCache
from services.models.loader import CheckpointError
from services.models.rope import cos_sin_cache
from services.models.weight_layout import column_major_linears

SLIDING = "sliding_attention"


class GemmaNorm(nn.Module):
    """RMSNorm scaling by (1 + w), kept in fp32 whatever the model's dtype, as
    transformers computes it (the checkpoint's w plus 1, rounded to bf16, would move every
    norm by up to 0.4 %); the residual add, when given, in the activations' dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * self.weight).to(x.dtype)
        return out if residual is None else (out, x)


class Gemma3Attention(Attention):
    def __init__(self, cfg, backend: Backend, layer_type: str):
        super().__init__(cfg, backend, qkv_bias=False, qk_norm=True)
        self.q_norm = GemmaNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        # Set by the model for a step with image rows: the last key position each row
        # of the step sees (an image's rows see the whole image); None: causal.
        self.last_seen: torch.Tensor | None = None

    def norm(self, x: torch.Tensor, norm: GemmaNorm) -> torch.Tensor:
        return norm(x)

    def attend(self, q, kv: KVCache, meta, keep) -> torch.Tensor:
        if self.window is None and self.last_seen is None:
            return super().attend(q, kv, meta, keep)
        last = self.last_seen
        if keep is not None:
            q, meta = q.index_select(0, keep.rows), keep.meta
            last = last.index_select(0, keep.rows) if last is not None else None
        return torch_backend.masked_attention(q, kv[0], kv[1], meta, self.scale, self.window, last)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise CheckpointError(f"unsupported activation {cfg.hidden_activation!r}")
        self.backend = backend
        self.inter = cfg.intermediate_size
        self.shard_sizes = [self.inter, self.inter]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, h):
        gate, up = self.backend.linear(h, self.gate_up_proj.weight).split(self.inter, dim=-1)
        return self.backend.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, layer_type: str):
        super().__init__()
        self.backend = backend
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(cfg, backend, layer_type)
        self.mlp = Gemma3MLP(cfg, backend)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaNorm(cfg.hidden_size, eps)

    def forward(self, positions, h, kv, meta, rope, keep=None):
        a = self.self_attn(positions, self.input_layernorm(h), kv, meta, rope, keep)
        if keep is not None:
            h = h.index_select(0, keep.rows)
        a = self.post_attention_layernorm(a)
        x, h = self.pre_feedforward_layernorm(a, residual=h)  # h += a
        return h + self.post_feedforward_layernorm(self.mlp(x))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, backend, kind) for kind in cfg.layer_types
        )
        self.norm = GemmaNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions, h, kv_caches, meta, ropes: dict, keep=None, aux_layers=(), last_seen=None
    ):
        """``last_seen``: see Gemma3Attention (None: every row causal)."""
        if aux_layers:
            raise ValueError("Gemma 3 hands no hidden states to draft heads")
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer.self_attn.last_seen = last_seen
            try:
                rope = ropes[layer.layer_type]
                h = layer(positions, h, kv, meta, rope, keep if i == last else None)
            finally:
                layer.self_attn.last_seen = None
        return self.norm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Text decoder with the causal-LM interface of ``LlamaForCausalLM`` (its head,
    logits and weight loading; the layers are Gemma's)."""

    supports_aux_hidden = False

    def __init__(self, cfg, backend: Backend, max_positions: int):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3TextModel(cfg, backend)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.tie:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        for kind in set(cfg.layer_types):
            table = cos_sin_cache(cfg, attn.head_dim, max_positions, kind)
            self.register_buffer(f"rope_{kind}", table, False)
        self.embed_scale = cfg.hidden_size**0.5
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        column_major_linears(self)

    @property
    def ropes(self) -> dict[str, torch.Tensor]:
        return {kind: getattr(self, f"rope_{kind}") for kind in set(self.config.layer_types)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        # transformers scales by sqrt(hidden) rounded to the weights' dtype.
        return F.embedding(input_ids, weight) * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def forward(
        self, positions, inputs_embeds, kv_caches, meta, keep=None, aux_layers=(), last_seen=None
    ):
        return self.model(
            positions, inputs_embeds, kv_caches, meta, self.ropes, keep, aux_layers, last_seen
        )

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._capped(super().compute_logits(hidden))

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return self._capped(super().pair_logits(hidden, token_ids))

    def decode_greedy(self, tokens, positions, kv_caches, meta, steps: int):
        return None  # the native burst runs Llama layers only

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As Llama's, after adding 1 to every norm weight (Gemma's norms scale by 1 + w)."""
        super().load_weights(
            (name, tensor.float() + 1 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
