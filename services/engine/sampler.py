"""From one step's logits to tokens: penalties, min_tokens, logprobs, then the backend."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from services.engine.request import Request
from services.engine.thinking import forced_token
from services.kernels.backend import Backend
from services.kernels.metadata import SamplingTensors
from services.outputs import TokenLogprobs
from services.structured.matcher import apply_masks, forbidden_tokens


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Repetition (HF-style, prompt + output), frequency and presence (output) penalties."""
    for i, req in enumerate(reqs):
        sp = req.sampling_params
        if not sp.has_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
            )
        if req.output_token_ids and (sp.frequency_penalty or sp.presence_penalty):
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def force_thinking_end(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Rows whose thinking budget forces a token allow only it (in place)."""
    for i, req in enumerate(reqs):
        token = forced_token(req)
        if token is not None:
            logits[i, :token] = float("-inf")
            logits[i, token + 1 :] = float("-inf")


def mask_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Before min_tokens, no stop token may be drawn (unless a grammar has ended: its end
    wins, as its mask then allows nothing else)."""
    for i, req in enumerate(reqs):
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens or sp.structured_outputs is not None:
            continue
        banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(req.eos_token_ids))
        banned = [t for t in banned if 0 <= t < logits.shape[1]]
        if banned:
            logits[i, banned] = float("-inf")
    return logits


def sampling_tensors(reqs: list[Request], seeds: list[int], device) -> SamplingTensors:
    sps = [r.sampling_params for r in reqs]
    temp = [0.0 if sp.greedy else sp.temperature for sp in sps]
    # Three tensors (rows of the float and int64 ones are the fields): every step builds
    # these, and each torch.tensor / host-to-device copy costs more than its contents.
    floats = torch.tensor(
        [temp, [sp.top_p for sp in sps], [sp.min_p for sp in sps]], dtype=torch.float32
    ).to(device)
    ints = torch.tensor([seeds, [r.num_tokens for r in reqs]], dtype=torch.int64).to(device)
    return SamplingTensors(
        temperature=floats[0],
        top_k=torch.tensor([sp.top_k for sp in sps], dtype=torch.int32, device=device),
        top_p=floats[1],
        min_p=floats[2],
        seeds=ints[0],
        positions=ints[1],
        all_greedy=all(t == 0.0 for t in temp),
        no_top_k=all(sp.top_k == 0 for sp in sps),
        no_top_p=all(sp.top_p >= 1.0 for sp in sps),
        no_min_p=all(sp.min_p == 0.0 for sp in sps),
    )


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Request]):
    """Raw-distribution logprobs for requests that asked for them (None elsewhere)."""
    want = [r.sampling_params.logprobs for r in reqs]
    if all(w is None for w in want):
        return [None] * len(reqs)
    lp = torch.log_softmax(logits, dim=-1)
    n = max(w or 0 for w in want)
    top_vals, top_ids = lp.topk(max(n, 1), dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
    out: list[TokenLogprobs | None] = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist(), strict=True))
        out.append(TokenLogprobs(int(tokens[i]), float(chosen[i]), int(ranks[i]), top))
    return out


def sample(
    logits: torch.Tensor,
    reqs: list[Request],
    seeds: list[int],
    backend: Backend,
    masks: Future | None = None,
):
    """logits [S, V] fp32 (raw; constrained rows masked in place) -> (token ids [S],
    per-request logprobs or None).

    A constrained row's grammar masks its logits first, so everything after (penalties,
    the draw, logprobs) sees the constrained distribution; its matcher then advances
    over the token drawn. ``masks``: those rows' forbidden tokens, started before the
    forward (``start_masks``); else they are computed here."""
    constrained = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if constrained:
        if masks is not None:
            forbidden = masks.result()
        else:
            forbidden = forbidden_tokens([reqs[i].grammar for i in constrained])
        apply_masks(logits, constrained, forbidden)  # in place: raw logits are not kept
    force_thinking_end(logits, reqs)
    raw = logits
    if any(r.sampling_params.has_penalties or r.sampling_params.min_tokens for r in reqs):
        logits = mask_min_tokens(apply_penalties(logits.clone(), reqs), reqs)
    tokens = backend.sample(logits, sampling_tensors(reqs, seeds, logits.device))
    for i in constrained:
        reqs[i].grammar.accept(int(tokens[i]))
    return tokens, compute_logprobs(raw, tokens, reqs)
