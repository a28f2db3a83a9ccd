"""The Llama-family decoder stack: RMSNorm, attention and MLP on the paged KV cache,
their layers, and the model body (embedding, layers, final norm) that hands a pure
decode step to the backend's one-call ``decode_stack`` when it has one.

The causal-LM wrappers and weight loading are in llama.py.
"""

from __future__ import annotations

import torch
from torch import nn

from services.kernels.backend import Backend
from services.kernels.metadata import (
    AttentionMetadata,
    DecoderLayerWeights,
    DecoderStack,
    OutputRows,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    # Rotary positions on q and k (Nemotron-H's attention layers have none).
    rotary = True

    def __init__(self, cfg, backend: Backend, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.backend = backend
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        bias = qkv_bias or getattr(cfg, "attention_bias", False)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        o_bias = getattr(cfg, "attention_bias", False) and not qkv_bias
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        positions,
        h,
        kv: KVCache,
        meta: AttentionMetadata,
        rope: torch.Tensor,
        keep: OutputRows | None = None,
    ):
        t = h.shape[0]
        qkv = self.backend.linear(h, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            d = self.head_dim
            q = self.norm(q.reshape(-1, d), self.q_norm).view(t, self.num_heads, d)
            k = self.norm(k.reshape(-1, d), self.k_norm).view(t, self.num_kv_heads, d)
        q, k = q.contiguous(), k.contiguous()
        if self.rotary:
            self.backend.rotary(positions, q, k, rope, True)
        self.backend.write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        o = self.attend(q, kv, meta, keep)
        o = o.reshape(o.shape[0], self.q_size)
        return self.backend.linear(o, self.o_proj.weight, self.o_proj.bias)

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The per-head q / k norm (a model whose norms differ overrides this)."""
        return self.backend.rms_norm(x, norm.weight, norm.eps)

    def attend(self, q, kv: KVCache, meta: AttentionMetadata, keep: OutputRows | None):
        """Causal attention of the rotated queries over the cache, for the ``keep`` rows
        only when given (every row's K/V is written by now). A model with other masks
        overrides this."""
        if keep is not None:
            q, meta = q.index_select(0, keep.rows), keep.meta
        return self.backend.attention(q, kv[0], kv[1], meta, self.scale)


class MLP(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend = backend
        bias = getattr(cfg, "mlp_bias", False)
        self.inter = cfg.intermediate_size
        self.shard_sizes = [self.inter, self.inter]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")

    def forward(self, h):
        be = self.backend
        act = be.silu_mul(be.linear(h, self.gate_up_proj.weight, self.gate_up_proj.bias))
        return be.linear(act, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, qkv_bias: bool, qk_norm: bool, mlp=None):
        """``mlp``: the layer's feed-forward module (default: the dense gated MLP)."""
        super().__init__()
        self.backend = backend
        self.self_attn = Attention(cfg, backend, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else MLP(cfg, backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, kv, meta, rope, keep: OutputRows | None = None):
        norm = self.input_layernorm
        if residual is None:
            residual = h
            h = self.backend.rms_norm(h, norm.weight, norm.eps)
        else:
            h, residual = self.backend.rms_norm(h, norm.weight, norm.eps, residual)
        h = self.self_attn(positions, h, kv, meta, rope, keep)
        if keep is not None:
            residual = residual.index_select(0, keep.rows)
        norm = self.post_attention_layernorm
        h, residual = self.backend.rms_norm(h, norm.weight, norm.eps, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, backend: Backend, qkv_bias: bool, qk_norm: bool, make_mlp=None):
        """``make_mlp(layer index)``: a layer's feed-forward module, or None for the dense
        one (mixture-of-experts models, moe.py); the native decode stack takes dense
        layers only."""
        super().__init__()
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        mlps = [make_mlp(i) if make_mlp else None for i in range(cfg.num_hidden_layers)]
        self.dense = all(m is None for m in mlps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, qkv_bias, qk_norm, m) for m in mlps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.stack: DecoderStack | None = None  # built on first use, after loading

    def forward(
        self,
        positions,
        h,
        kv_caches,
        meta,
        rope,
        keep: OutputRows | None = None,
        aux_layers: tuple[int, ...] = (),
        layer_adds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Hidden states of every row, or of the ``keep`` rows only (see ``OutputRows``).

        With ``aux_layers`` (speculative decoding's draft heads, never with ``keep``):
        (hidden, aux) where aux [T, len(aux_layers) * H] holds the outputs of those
        layers (residual stream after the layer), concatenated in the order given.
        ``layer_adds`` (rows [N], values [L, N, H]): added to those rows of the residual
        stream after each of the first L layers (Qwen3-VL's deepstack image features).
        """
        if aux_layers and keep is not None:
            raise ValueError("aux hidden states are captured for every row (no keep)")
        stack = self.native_stack(rope) if keep is None and meta.is_decode_only else None
        if stack is not None and layer_adds is None:
            out = self.backend.decode_stack(stack, positions, h, kv_caches, meta, aux_layers)
            if out is not None:
                return out
        residual = None
        last = len(self.layers) - 1
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = layer(positions, h, residual, kv, meta, rope, keep if i == last else None)
            if layer_adds is not None and i < layer_adds[1].shape[0]:
                h = h.index_add(0, layer_adds[0], layer_adds[1][i].to(h.dtype))
            if i in aux_layers:  # the layer's output: its MLP output added to the residual
                captured[i] = h + residual
        h, _ = self.backend.rms_norm(h, self.norm.weight, self.norm.eps, residual)
        if aux_layers:
            return h, torch.cat([captured[i] for i in aux_layers], dim=-1)
        return h

    def native_stack(self, rope: torch.Tensor) -> DecoderStack | None:
        """The layers as one DecoderStack for ``Backend.decode_stack``; None where they are
        not all dense (the step then runs layer by layer)."""
        if not self.dense:
            return None
        if self.stack is None or self.stack.rope is not rope:
            self.stack = DecoderStack(
                layers=[_layer_weights(layer) for layer in self.layers],
                final_norm=self.norm.weight,
                rope=rope,
                eps=self.norm.eps,
                num_heads=self.layers[0].self_attn.num_heads,
                num_kv_heads=self.layers[0].self_attn.num_kv_heads,
                head_dim=self.layers[0].self_attn.head_dim,
                hidden_size=self.embed_tokens.embedding_dim,
                intermediate_size=self.layers[0].mlp.inter,
            )
        return self.stack


def _layer_weights(layer: DecoderLayer) -> DecoderLayerWeights:
    a, mlp = layer.self_attn, layer.mlp
    return DecoderLayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=a.qkv_proj.weight,
        qkv_bias=a.qkv_proj.bias,
        q_norm=a.q_norm.weight if a.q_norm is not None else None,
        k_norm=a.k_norm.weight if a.k_norm is not None else None,
        o=a.o_proj.weight,
        o_bias=a.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias,
        down=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
    )
