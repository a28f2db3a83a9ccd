"""A lean forward of all-MiniLM-L6-v2 (a 6-layer BERT) for short questions.

The semantic tier embeds one question per lookup: ~16 tokens, where transformers'
``BertModel`` spends as long in Python (module calls, masks, dtype checks) as in its
matrix products. This is the same arithmetic on the same weights, written as plain
torch ops: one fused QKV product per layer, SDPA, exact (erf) GELU, LayerNorm with the
model's epsilon.

Its products come from a ``DenseMaker``, called once per weight:
- ``fp32_dense``: float32, on ``F.linear`` or the engine's native CPU GEMV (a question is
  ~12 rows against 42 MB of layer weights; a kernel that streams each weight once beats
  MKL's small-M GEMM, ~23 -> ~14 ms on one core). Vectors within 1e-6 of ``BertModel``'s.
- ``bf16_dense``: bfloat16 weights packed once for oneDNN, which runs them on AMX tiles
  or AVX512_BF16 where the CPU has them (fp32 sums, the GELU fused in): 8.0-8.4 -> 5.5-5.7
  ms a question on a Xeon with AMX, ~8.6 -> ~6.1 on an AMD EPYC with AVX512_BF16, cosines
  within 2e-3 of float32's
  (docs/semantic-cache.md, "Embedding in bfloat16").
LayerNorm, attention and the residual stream stay float32 either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# y = x @ W^T + b for 2-D x: F.linear, or a backend's ``linear``.
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# One dense layer, made once: x [N, in] -> float32 [N, out].
Dense = Callable[[torch.Tensor], torch.Tensor]
# (W [out, in], b [out], GELU after it?) -> its Dense.
DenseMaker = Callable[[torch.Tensor, torch.Tensor, bool], Dense]


def fp32_dense(linear: Linear = F.linear) -> DenseMaker:
    """Products in float32 on ``linear``, the weights used in the layout they have."""

    def make(w: torch.Tensor, b: torch.Tensor, gelu: bool) -> Dense:
        if gelu:
            return lambda x: F.gelu(linear(x, w, b))
        return lambda x: linear(x, w, b)

    return make


def bf16_dense(w: torch.Tensor, b: torch.Tensor, gelu: bool) -> Dense:
    """bfloat16 weights in oneDNN's blocked layout (packed here, once, for ~16 rows), the
    input cast to bfloat16, the sums in float32, the output rounded to bfloat16."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous().to(torch.bfloat16), 16)
    bias = b.to(torch.bfloat16)
    attr, algorithm = ("gelu", "none") if gelu else ("none", "")  # "none": erf, not tanh
    op = torch.ops.mkldnn._linear_pointwise

    def dense(x: torch.Tensor) -> torch.Tensor:
        return op(x.to(torch.bfloat16), packed, bias, attr, [], algorithm).float()

    return dense


@dataclass
class _Layer:
    qkv: Dense  # H -> 3H: query, key, value
    out: Dense  # H -> H
    ln1: tuple[torch.Tensor, torch.Tensor]  # after attention: weight, bias [H]
    up: Dense  # H -> I, with the GELU
    down: Dense  # I -> H
    ln2: tuple[torch.Tensor, torch.Tensor]  # after the feed-forward [H]


class LeanBert:
    """``BertModel``'s last hidden state from its weights, without the module tree."""

    def __init__(self, model: torch.nn.Module, dense: DenseMaker | None = None) -> None:
        """``model``: a loaded transformers ``BertModel``; ``dense`` makes its products
        (default: float32 ``F.linear``)."""
        cfg = model.config
        dense = dense or fp32_dense()
        self.heads, self.eps = cfg.num_attention_heads, cfg.layer_norm_eps
        if cfg.hidden_act != "gelu" or cfg.position_embedding_type != "absolute":
            raise ValueError("LeanBert covers BERT with exact GELU and absolute positions")
        emb = model.embeddings
        self.words = emb.word_embeddings.weight
        self.positions = emb.position_embeddings.weight
        self.type0 = emb.token_type_embeddings.weight[0]  # one segment: every token is type 0
        self.ln0 = (emb.LayerNorm.weight, emb.LayerNorm.bias)
        self.layers = [_layer(layer, dense) for layer in model.encoder.layer]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, T] (mask 1 = token, 0 = padding) -> hidden states [B, T, H]."""
        b, t = ids.shape
        x = self.words[ids] + self.positions[:t] + self.type0
        x = F.layer_norm(x, x.shape[-1:], *self.ln0, self.eps)
        # Padding keys get -inf-like scores (BERT adds the dtype's min); none: no mask.
        bias = None
        if not bool(mask.all()):
            bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = self._layer(x, layer, bias, b, t)
        return x

    def _layer(self, x: torch.Tensor, p: _Layer, bias, b: int, t: int) -> torch.Tensor:
        h = x.shape[-1]
        qkv = _apply(p.qkv, x).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, d]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        att = att.transpose(1, 2).reshape(b, t, h)
        x = F.layer_norm(_apply(p.out, att) + x, (h,), *p.ln1, self.eps)
        ff = _apply(p.down, _apply(p.up, x))
        return F.layer_norm(ff + x, (h,), *p.ln2, self.eps)


def _apply(dense: Dense, x: torch.Tensor) -> torch.Tensor:
    """A Dense over the last dimension of x [..., in]."""
    y = dense(x.reshape(-1, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


def _layer(layer: torch.nn.Module, dense: DenseMaker) -> _Layer:
    att = layer.attention
    s = att.self
    ws = [s.query.weight, s.key.weight, s.value.weight]
    column_major = ws[0].stride(0) == 1  # W^T in memory: stack the W^Ts side by side
    qkv_w = torch.cat([w.t() for w in ws], dim=1).t() if column_major else torch.cat(ws)
    qkv_b = torch.cat([s.query.bias, s.key.bias, s.value.bias]).contiguous()
    return _Layer(
        qkv=dense(qkv_w, qkv_b, False),
        out=dense(att.output.dense.weight, att.output.dense.bias, False),
        ln1=(att.output.LayerNorm.weight, att.output.LayerNorm.bias),
        up=dense(layer.intermediate.dense.weight, layer.intermediate.dense.bias, True),
        down=dense(layer.output.dense.weight, layer.output.dense.bias, False),
        ln2=(layer.output.LayerNorm.weight, layer.output.LayerNorm.bias),
    )
