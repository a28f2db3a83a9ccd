"""A lean forward of all-MiniLM-L6-v2 (a 6-layer BERT) for short questions.

The semantic tier embeds one question per lookup: ~16 tokens, where transformers'
``BertModel`` spends as long in Python (module calls, masks, dtype checks) as in its
matrix products. This is the same arithmetic on the same weights, written as plain
torch ops: one fused QKV product per layer, SDPA, exact (erf) GELU, LayerNorm with the
model's epsilon. Its vectors match ``BertModel``'s within 1e-6
(tests/unit/test_minilm.py).

The products can run on the engine's native CPU GEMV (``SentenceEmbedder`` passes it):
a question is ~12 rows against 42 MB of layer weights, past the L3 cache, so a kernel
that streams each weight once beats MKL's small-M GEMM (~23 -> ~14 ms on one core).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# y = x @ W^T + b for 2-D x: F.linear, or a backend's ``linear``.
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    qkv_w: torch.Tensor  # [3H, H]: query, key, value rows stacked
    qkv_b: torch.Tensor  # [3H]
    out_w: torch.Tensor  # [H, H]
    out_b: torch.Tensor  # [H]
    ln1: tuple[torch.Tensor, torch.Tensor]  # after attention: weight, bias [H]
    up_w: torch.Tensor  # [I, H]
    up_b: torch.Tensor  # [I]
    down_w: torch.Tensor  # [H, I]
    down_b: torch.Tensor  # [H]
    ln2: tuple[torch.Tensor, torch.Tensor]  # after the feed-forward [H]


class LeanBert:
    """``BertModel``'s last hidden state from its weights, without the module tree."""

    def __init__(self, model: torch.nn.Module, linear: Linear = F.linear) -> None:
        """``model``: a loaded transformers ``BertModel`` (its weights are shared, in the
        layout they have: the fused QKV weight keeps it too)."""
        cfg = model.config
        self.linear = linear
        self.heads, self.eps = cfg.num_attention_heads, cfg.layer_norm_eps
        if cfg.hidden_act != "gelu" or cfg.position_embedding_type != "absolute":
            raise ValueError("LeanBert covers BERT with exact GELU and absolute positions")
        emb = model.embeddings
        self.words = emb.word_embeddings.weight
        self.positions = emb.position_embeddings.weight
        self.type0 = emb.token_type_embeddings.weight[0]  # one segment: every token is type 0
        self.ln0 = (emb.LayerNorm.weight, emb.LayerNorm.bias)
        self.layers = [_layer(layer) for layer in model.encoder.layer]

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
        qkv = self._dense(x, p.qkv_w, p.qkv_b).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, d]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        att = att.transpose(1, 2).reshape(b, t, h)
        x = F.layer_norm(self._dense(att, p.out_w, p.out_b) + x, (h,), *p.ln1, self.eps)
        ff = self._dense(F.gelu(self._dense(x, p.up_w, p.up_b)), p.down_w, p.down_b)
        return F.layer_norm(ff + x, (h,), *p.ln2, self.eps)

    def _dense(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])


def _layer(layer: torch.nn.Module) -> _Layer:
    att = layer.attention
    s = att.self
    ws = [s.query.weight, s.key.weight, s.value.weight]
    column_major = ws[0].stride(0) == 1  # W^T in memory: stack the W^Ts side by side
    return _Layer(
        qkv_w=torch.cat([w.t() for w in ws], dim=1).t() if column_major else torch.cat(ws),
        qkv_b=torch.cat([s.query.bias, s.key.bias, s.value.bias]).contiguous(),
        out_w=att.output.dense.weight, out_b=att.output.dense.bias,
        ln1=(att.output.LayerNorm.weight, att.output.LayerNorm.bias),
        up_w=layer.intermediate.dense.weight, up_b=layer.intermediate.dense.bias,
        down_w=layer.output.dense.weight, down_b=layer.output.dense.bias,
        ln2=(layer.output.LayerNorm.weight, layer.output.LayerNorm.bias),
    )  # fmt: skip
