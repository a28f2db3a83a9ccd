"""Random-weight EAGLE-3 / P-EAGLE heads in the Speculators layout, written for a target."""

from __future__ import annotations

from pathlib import Path

import torch

from services.models.eagle3 import Eagle3Head
from services.models.eagle3_config import Eagle3Config


def head_config(
    target,
    kind: str = "eagle3",
    draft_vocab: int | None = None,
    aux: tuple[int, ...] | None = None,
    **over,
) -> Eagle3Config:
    """A one-layer head shaped for ``target`` (a transformers config)."""
    n = target.num_hidden_layers
    kw = dict(
        model_type=kind,
        layer_type="llama",
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=target.hidden_size // 4,
        rms_norm_eps=1e-6,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab or target.vocab_size,
        aux_layer_ids=aux or tuple(sorted({1, max(1, n // 2), n})),
        target_hidden_size=target.hidden_size,
        rope={"rope_type": "default", "rope_theta": 10000.0},
        mask_token_id=0 if kind == "peagle" else None,
        verifier={"name_or_path": None, "architectures": list(target.architectures or [])},
    )
    kw.update(over)
    return Eagle3Config(**kw)


def make_eagle_head(root: Path, target, kind: str = "eagle3", seed: int = 0, **over) -> Path:
    """Write a random head (normal(0, 0.2) matrices, so drafts are not all one token)."""
    cfg = head_config(target, kind, **over)
    out = root / f"{kind}-head-{seed}"
    head = Eagle3Head(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2 or name == "mask_hidden":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        if head.d2t is not None:  # draft id i -> an evenly spread target id
            picked = torch.linspace(0, cfg.vocab_size - 1, cfg.draft_vocab_size).long()
            head.d2t.copy_(picked - torch.arange(cfg.draft_vocab_size))
            head.t2d.zero_()
            head.t2d[picked] = True
    head.save_pretrained(out)
    return out
