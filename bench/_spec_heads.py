"""The speculative-decoding benchmark's recipe, part 2: EAGLE-3 and P-EAGLE heads.

Both heads learn the target's next-token distribution (soft cross-entropy against the
target's probabilities) from the target's own hidden states, over a fixed pool of
sequences: half stdlib windows, half the target's own greedy continuations of stdlib
prefixes (what it will see when serving greedy requests).

* EAGLE-3: training-time test (TTT) as in the EAGLE-3 paper and Speculators: step 0 reads
  target rows; steps 1..2 read the head's own previous output as the feature, attending
  to the step-0 entries up to their anchor and to their own chain (a diagonal per step).
* P-EAGLE: one forward over the step-0 rows plus, for every anchor, depths 1..K-1 made
  of the mask token and the learned shared feature ``mask_hidden`` (the P-EAGLE paper's
  parallel groups); depth d attends to step-0 rows up to its anchor and to its own
  chain's shallower depths. Every depth is trained (no subsampling: the pool is small).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.models.eagle3 import Eagle3Head
from services.models.eagle3_config import Eagle3Config

log = logging.getLogger("bench.spec")


@dataclass(frozen=True)
class HeadRecipe:
    """Sizes and steps of head training."""

    pool: int = 128  # training sequences (half corpus windows, half target continuations)
    seq: int = 64
    prefix: int = 16  # corpus tokens the target continues from
    steps: int = 100  # EAGLE-3
    batch: int = 8
    peagle_steps: int = 150  # P-EAGLE learns 8 depths at once: it needs more
    peagle_batch: int = 8
    lr: float = 3e-3
    ttt: int = 3  # EAGLE-3 training-time-test steps
    depths: int = 8  # P-EAGLE: drafts one forward is trained for (k up to 8)
    seed: int = 0


@dataclass
class Pool:
    """What head training reads, computed once from the target."""

    tokens: torch.Tensor  # [N, T] token ids
    aux: torch.Tensor  # [N, T, naux * H] the target's rows at the aux layers
    probs: torch.Tensor  # [N, T, V] the target's next-token distribution


@torch.no_grad()
def build_pool(target, stream: torch.Tensor, aux_ids: tuple[int, ...], r: HeadRecipe) -> Pool:
    gen = torch.Generator().manual_seed(r.seed + 1)
    half = r.pool // 2
    starts = torch.randint(0, len(stream) - r.seq, (r.pool,), generator=gen).tolist()
    corpus = torch.stack([stream[s : s + r.seq] for s in starts[:half]])
    prompts = torch.stack([stream[s : s + r.prefix] for s in starts[half:]])
    generated = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=r.seq - r.prefix,
        min_new_tokens=r.seq - r.prefix,
        pad_token_id=target.config.pad_token_id,
    )
    tokens = torch.cat([corpus, generated[:, : r.seq]])
    aux, probs = [], []
    for chunk in tokens.split(64):
        rows, logits = target_rows(target, chunk, aux_ids)
        aux.append(rows)
        probs.append(logits.float().softmax(-1))
    return Pool(tokens, torch.cat(aux), torch.cat(probs))


@torch.no_grad()
def target_rows(target, ids: torch.Tensor, aux_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, naux * H] outputs of layers id - 1, logits [B, T, V]) for ``ids`` [B, T].

    Hooks read each layer's own output, as the engine hands it over. transformers'
    ``hidden_states[n]`` would be wrong for the last layer: it is after the final norm."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        target.model.layers[i - 1].register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in aux_ids
    ]
    try:
        logits = target(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in aux_ids], dim=-1), logits


def new_head(
    target, kind: str, aux_ids: tuple[int, ...], mask_id: int, target_dir: Path
) -> Eagle3Head:
    """A head shaped like one target layer, embeddings/lm_head/norm copied from the target."""
    c = target.config
    cfg = Eagle3Config(
        model_type=kind,
        layer_type="llama",
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size,
        draft_vocab_size=c.vocab_size,
        aux_layer_ids=aux_ids,
        target_hidden_size=c.hidden_size,
        rope={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096,
        mask_token_id=mask_id if kind == "peagle" else None,
        verifier={"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
        speculative_tokens=5,
    )
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.weight.copy_(target.model.norm.weight)
        if cfg.parallel:
            head.mask_hidden.normal_(0.0, 0.1)
    # EAGLE-3 keeps the target's embeddings; P-EAGLE trains them (its mask token's row).
    head.embed_tokens.weight.requires_grad_(cfg.parallel)
    return head


def _soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return -(probs * F.log_softmax(logits, -1)).sum(-1).mean()


def eagle3_loss(head: Eagle3Head, x, aux, probs, ttt: int) -> torch.Tensor:
    """TTT loss over [B, T] sequences (see the module docstring)."""
    b, t = x.shape
    n = t - 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    toks, feats = x[:, 1:], head.fuse(aux[:, :-1])
    pos = torch.arange(1, t)[None].expand(b, -1)
    keys_k = keys_v = None
    loss = torch.zeros(())
    for s in range(ttt):
        mask = torch.cat([causal] + [eye] * s, dim=1)
        out, k, v = head.step(toks, feats, pos + s, keys_k, keys_v, mask)
        keys_k = k if keys_k is None else torch.cat([keys_k, k], dim=2)
        keys_v = v if keys_v is None else torch.cat([keys_v, v], dim=2)
        logits, feats = head.readout(out)
        valid = n - s  # anchors whose step-s target is inside the sequence
        loss = loss + _soft_ce(logits[:, :valid], probs[:, 1 + s : 1 + s + valid])
        toks = torch.cat([x[:, 2 + s :], x.new_zeros(b, s + 1)], dim=1)
    return loss / ttt


def peagle_mask(n: int, depths: int) -> torch.Tensor:
    """[(depths n), (depths n)] bool over rows ordered (depth, anchor)."""
    d = torch.arange(depths).repeat_interleave(n)
    a = torch.arange(n).repeat(depths)
    base = (d[None, :] == 0) & (a[None, :] <= a[:, None])
    chain = (a[None, :] == a[:, None]) & (d[None, :] <= d[:, None])
    return base | chain


def peagle_loss(head: Eagle3Head, x, aux, probs, depths: int) -> torch.Tensor:
    """Parallel-group loss: all depths from one forward (see the module docstring)."""
    b, t = x.shape
    n = t - 1
    mask_id = head.cfg.mask_token_id
    toks = torch.cat([x[:, 1:], x.new_full((b, (depths - 1) * n), mask_id)], dim=1)
    fill = head.mask_feature().expand(b, (depths - 1) * n, -1)
    feats = torch.cat([head.fuse(aux[:, :-1]), fill], dim=1)
    pos = torch.arange(1, t).repeat(depths) + torch.arange(depths).repeat_interleave(n)
    out, _, _ = head.step(toks, feats, pos[None].expand(b, -1), None, None, peagle_mask(n, depths))
    logits, _ = head.readout(out)
    loss = torch.zeros(())
    for d in range(depths):
        valid = n - d
        rows = logits[:, d * n : d * n + valid]
        loss = loss + _soft_ce(rows, probs[:, 1 + d : 1 + d + valid])
    return loss / depths


def train_head(head: Eagle3Head, pool: Pool, r: HeadRecipe) -> Eagle3Head:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(r.seed + 2)
    parallel = head.cfg.parallel
    batch = r.peagle_batch if parallel else r.batch
    steps = r.peagle_steps if parallel else r.steps
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = r.lr * min(1.0, (step + 1) / 10) * (1 - step / steps)
        idx = torch.randint(0, len(pool.tokens), (batch,), generator=gen)
        x, aux, probs = pool.tokens[idx], pool.aux[idx], pool.probs[idx]
        if parallel:
            loss = peagle_loss(head, x, aux, probs, r.depths)
        else:
            loss = eagle3_loss(head, x, aux, probs, r.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            log.info(
                "%s step %d/%d loss %.3f (%.0f s)",
                head.cfg.model_type,
                step,
                steps,
                loss.item(),
                time.perf_counter() - t0,
            )
    return head.eval()
