"""EAGLE-3 / P-EAGLE draft head: one decoder layer over [embed(token) ; fc(target hidden)].

The head reads the target's hidden states at a few layers (concatenated), projects them
with ``fc`` to its own width, and runs one decoder layer whose attention input is the
token embedding and that feature side by side (q/k/v take 2 x hidden_size); the feature
is the residual stream. Its lm_head covers a smaller draft vocabulary mapped back to
target ids by ``d2t`` (an offset per draft id: target = draft + d2t[draft]). P-EAGLE adds
``mask_hidden``, a learned stand-in for the unknown target hidden state of positions
2..K, used with the embedding of ``mask_token_id``.

Parameter names are Speculators' own, so ``state_dict`` is the checkpoint. The draft
layer's KV is the caller's (dense, per request: spec/eagle.py); this module is pure math
over ``[B, T, ...]`` rows with an explicit boolean attention mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from services.models.checkpoint import read_json
from services.models.eagle3_config import DraftHeadError, Eagle3Config
from services.models.loader import iter_weights, load_into
from services.models.rope import cos_sin_cache


class _RMSNorm(nn.Module):
    """RMSNorm computed as transformers' Llama/Qwen3 norm (fp32 inside); through the
    backend's native norm when one is set (``Eagle3Head.use_backend``, inference only)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = None  # a Backend: torch's rms_norm is ~10 small ops, 50 us at one row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return self.ops.rms_norm(flat, self.weight, self.eps).view(x.shape)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary (transformers' rotate_half); x [B, T, heads, d], cos/sin [B, T, 1, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(
            2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias
        )
        self.v_proj = nn.Linear(
            2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        qk_norm = c.layer_type == "qwen3"
        self.q_norm = _RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.k_norm = _RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.ops = None  # a Backend for the rotary (in place), inference only

    def forward(self, x, rope, past_k, past_v, mask):
        """x [B, T, 2H]; rope: (positions [B, T], cos_sin table) with a backend, else
        (cos, sin) [B, T, 1, d]; past_k/v [B, kvh, L, d] or None; mask [B, 1, T, L + T]
        bool (True = attend). Returns (out [B, T, H], k [B, kvh, T, d], v [B, kvh, T, d])."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ops is not None:
            q, k = q.contiguous(), k.contiguous()  # q/k norms may hand back views
            self.ops.rotary(
                rope[0].reshape(-1),
                q.view(b * t, c.num_heads, c.head_dim),
                k.view(b * t, c.num_kv_heads, c.head_dim),
                rope[1],
                True,
            )
        else:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1)), k, v


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's first (only) layer: norms embed and feature apart, attends over both."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb, feat, rope, past_k, past_v, mask):
        residual = feat
        feat = self.hidden_norm(feat)
        if self.norm_before_residual:
            residual = feat
        x = torch.cat([self.input_layernorm(emb), feat], dim=-1)
        a, k, v = self.self_attn(x, rope, past_k, past_v, mask)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class Eagle3Head(nn.Module):
    """The draft head (see the module docstring); ``step`` runs the layer over new rows."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h, naux = cfg.hidden_size, len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(naux * cfg.target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        small = cfg.draft_vocab_size != cfg.vocab_size
        self.register_buffer(
            "d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long) if small else None
        )
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if small else None)
        if cfg.parallel:
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, naux * cfg.target_hidden_size))
        self._rope = cos_sin_cache(
            _rope_config(cfg), cfg.head_dim, max(cfg.max_position_embeddings, 64)
        )
        self._full: tuple[torch.Tensor, torch.Tensor] | None = None  # full-width cos, sin
        self._ops = None  # a Backend (use_backend)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., len(aux) * target_hidden] target rows -> [..., H] features."""
        return self.fc(hidden)

    def mask_feature(self) -> torch.Tensor:
        """P-EAGLE's shared feature for positions 2..K: fc(mask_hidden), [H]."""
        return self.fc(self.mask_hidden.view(-1))

    def step(self, tokens, feats, positions, past_k=None, past_v=None, mask=None):
        """tokens [B, T] target ids, feats [B, T, H], positions [B, T]; past K/V
        [B, kvh, L, d] or None; mask [B, 1, T, L + T] bool (None: plain causal, no past).
        Returns (out [B, T, H] layer output, k, v [B, kvh, T, d] to keep)."""
        emb = self.embed_tokens(tokens)
        rope = self._rope_for(positions, emb.dtype)
        if mask is None:
            t = tokens.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        return self.layers[0](emb, feats, rope, past_k, past_v, mask)

    def use_backend(self, backend) -> None:
        """Run norms and rotary through ``backend``'s native ops (fp32 CPU inference only:
        they cut a draft forward's per-op overhead; values agree with torch's to ~1e-7)."""
        self._ops = backend  # None: back to torch
        for m in self.modules():
            if isinstance(m, (_RMSNorm, _Attention)):
                m.ops = backend

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocab [.., Vd] fp32, the feature the next step gets [.., H])."""
        normed = self.norm(out)
        return self.lm_head(normed).float(), (normed if self.cfg.norm_output else out)

    def greedy(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(target ids of the draft argmax [..], the feature the next step gets [.., H]):
        ``readout`` then argmax, through the backend's GEMV + argmax when one is set (the
        lm_head is a weight-bound read, and the logits are never needed)."""
        normed = self.norm(out)
        feat = normed if self.cfg.norm_output else out
        if self._ops is None:
            return self.to_target(self.lm_head(normed).float().argmax(-1)), feat
        flat = normed.reshape(-1, normed.shape[-1]).contiguous()
        ids = self._ops.greedy_head(flat, self.lm_head.weight)
        return self.to_target(ids.view(normed.shape[:-1])), feat

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (the d2t offsets)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def _rope_for(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What the attention rotates with: (positions, table) for the backend's rotary,
        else full-width (cos, sin) [B, T, 1, d], from tables built once per length."""
        need = int(positions.max()) + 1
        if need > self._rope.shape[0]:  # long contexts: grow the table, never wrap
            self._rope = cos_sin_cache(_rope_config(self.cfg), self.cfg.head_dim, 2 * need)
            self._full = None
        if self._ops is not None:
            return positions, self._rope
        if self._full is None or self._full[0].device != positions.device:
            cos, sin = self._rope.to(positions.device).chunk(2, dim=-1)
            self._full = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
        cos, sin = self._full[0][positions], self._full[1][positions]
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    @classmethod
    def from_pretrained(
        cls, head_dir: str | Path, target_embed: torch.Tensor | None = None
    ) -> Eagle3Head:
        """Load a Speculators directory (config.json + safetensors). ``target_embed``
        fills ``embed_tokens`` when the checkpoint shares the target's embeddings."""
        head_dir = Path(head_dir)
        if not head_dir.is_dir():
            raise DraftHeadError(f"draft head directory {head_dir} does not exist")
        cfg = Eagle3Config.from_json(read_json(head_dir / "config.json"))
        head = cls(cfg)
        skip = ("verifier_norm.", "verifier_lm_head.")  # training-only, Speculators drops them
        weights = dict(iter_weights(head_dir, keep=lambda n: not n.startswith(skip)))
        if "embed_tokens.weight" not in weights:
            if target_embed is None:
                raise DraftHeadError(
                    f"{head_dir} has no embed_tokens and no target embeddings were given"
                )
            weights["embed_tokens.weight"] = target_embed
        if head.d2t is None:
            weights = {n: w for n, w in weights.items() if n not in ("d2t", "t2d")}
        unknown = sorted(set(weights) - set(head.state_dict()))
        if unknown:
            raise DraftHeadError(f"unexpected weights in {head_dir}: {unknown[:8]}")
        load_into(head, weights, f"draft head {head_dir.name}")
        return head

    def save_pretrained(self, head_dir: str | Path) -> None:
        """Write config.json and model.safetensors in the Speculators layout."""
        head_dir = Path(head_dir)
        head_dir.mkdir(parents=True, exist_ok=True)
        state = {n: t.detach().contiguous().cpu() for n, t in self.state_dict().items()}
        save_file(state, str(head_dir / "model.safetensors"), metadata={"format": "pt"})
        (head_dir / "config.json").write_text(json.dumps(self.cfg.to_json(), indent=2))


def _rope_config(cfg: Eagle3Config):
    from transformers import LlamaConfig  # the rope init functions read a config object

    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope),
    )
