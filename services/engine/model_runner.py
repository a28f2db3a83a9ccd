"""Builds one step's inputs from the scheduler output, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.kv_cache import KVCachePool
from services.engine.mamba_state import HybridCache
from services.engine.request import Request
from services.engine.sampler import sample
from services.engine.spec.verify import num_accepted, verify_row, verify_rows
from services.engine.step_images import StepImages, place
from services.engine.step_meta import (
    attn_meta,
    next_decode_meta,
    out_rows,
    to_tensor,
    verify_rows_meta,
)
from services.engine.thinking import forced_token
from services.kernels.backend import Backend
from services.kernels.metadata import AttentionMetadata, OutputRows
from services.outputs import TokenLogprobs
from services.structured.matcher import apply_masks, start_masks


@dataclass
class StepInputs:
    """Per-step inputs; long-lived per-request state lives in Request and the runner."""

    input_ids: torch.Tensor  # [T] int64, the new tokens of every scheduled request, packed
    positions: torch.Tensor  # [T] int64, their positions in their sequences
    attn: AttentionMetadata
    # Rows of the last new token of the S sampling requests; None when those are all the
    # rows, in order (a pure decode step): the model then returns every row as it is.
    out_rows: OutputRows | None
    sampling: list[Request]  # the S requests that sample this step, in row order
    # Image embedding rows to place: (first row in the step, embeddings [n, hidden]).
    mm_rows: list[tuple[int, torch.Tensor]]
    # M-RoPE models: rotary positions, [3, T] int64 when a row is an image token, else
    # [T] (positions shifted past the images); None for every other model.
    rope_positions: torch.Tensor | None = None
    # Models whose image tokens see the whole image (Gemma 3), in a step with image rows:
    # [T] int64, the last key position each row sees; None: causal.
    last_seen: torch.Tensor | None = None
    # Speculative decoding: each sampling request's drafts (its out rows: 1 + k of them,
    # the last ones of its query), and (request id, first row, rows) of every request.
    drafts: list[list[int]] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)
    # Hybrid models: each scheduled sequence's recurrent-state slot, [num_seqs] int64.
    state_slots: torch.Tensor | None = None


@dataclass
class StepOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]


@dataclass
class VerifyOutput:
    """A step with speculative decoding: per sampling request, the tokens it emits (its
    accepted drafts, then the target's token) and their logprobs when asked for."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]


class ModelRunner:
    """Owns the model, the KV pool and per-request tensors (image embeddings, seeds).
    ``hybrid``: a hybrid model's KV and recurrent-state pools (mamba_state.py)."""

    def __init__(
        self,
        model,
        kv: KVCachePool,
        backend: Backend,
        device: torch.device,
        hybrid: HybridCache | None = None,
    ):
        self.model = model
        self.kv = kv
        self.hybrid = hybrid
        # What each layer of the model keeps (the model reads it by layer index).
        self.layers = hybrid.layers if hybrid is not None else kv.layers
        self.backend = backend
        self.device = device
        self.block_size = kv.block_size
        self.images = StepImages(model, device)
        self.seeds: dict[str, int] = {}
        # Speculative decoding: target layers whose outputs the draft proposer needs
        # (captured only when set), and each request's rows not yet handed to it.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_rows: dict[str, list[torch.Tensor]] = {}

    def add_request(self, req: Request, seed: int, image_embeds: list[torch.Tensor]) -> None:
        self.seeds[req.request_id] = seed
        self.images.add(req.request_id, image_embeds)

    def drop_request(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)
        self.images.drop(request_id)
        self.aux_rows.pop(request_id, None)

    def take_aux_rows(self, request_id: str) -> torch.Tensor | None:
        """The request's captured aux hidden rows since the last call ([m, A]), if any."""
        rows = self.aux_rows.pop(request_id, None)
        if not rows:
            return None
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def prepare(self, scheduled) -> StepInputs:
        ids, pos, slots, qlens, seqlens, tables = [], [], [], [], [], []
        logits_idx, sample_seqs, sampling, drafts, spans = [], [], [], [], []
        row_tables: list[list[int]] = []  # each row's block table (a verification's rows)
        images = self.images.rows()
        bs = self.block_size
        for item in scheduled:
            req, start, n = item.request, item.start, item.num_new_tokens
            row0, k = len(ids), len(item.draft_token_ids)
            ids.extend(req.all_token_ids[start : start + n - k])
            ids.extend(item.draft_token_ids)
            pos.extend(range(start, start + n))
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            qlens.append(n)
            seqlens.append(start + n)
            tables.append(req.block_ids)
            row_tables.extend([req.block_ids] * n)
            spans.append((req.request_id, row0, n))
            images.add(req, start, n, row0)
            if start + n - k == req.num_tokens:  # the last known token (and drafts) sample
                logits_idx.extend(range(len(ids) - 1 - k, len(ids)))
                sample_seqs.extend([len(qlens) - 1] * (k + 1))
                sampling.append(req)
                drafts.append(item.draft_token_ids)
        # A verification (every row samples) the backend runs in one call: row by row.
        if any(drafts) and len(logits_idx) == len(ids) <= self.backend.stack_max_rows:
            attn = verify_rows_meta(pos, row_tables, slots, self.device)
            sample_seqs = list(range(len(ids)))
        else:
            attn = attn_meta(qlens, seqlens, tables, slots, self.device)
        return StepInputs(
            state_slots=self._state_slots(scheduled),
            input_ids=to_tensor(ids, torch.long, self.device),
            positions=to_tensor(pos, torch.long, self.device),
            attn=attn,
            out_rows=out_rows(logits_idx, sample_seqs, attn, pos, self.device),
            sampling=sampling,
            mm_rows=images.mm_rows,
            drafts=drafts,
            spans=spans,
            rope_positions=images.rope_positions(),
            last_seen=images.last_seen(pos),
        )

    def _state_slots(self, scheduled) -> torch.Tensor | None:
        """Hybrid models: the scheduled sequences' state slots, those starting from their
        first token reset to zero."""
        if self.hybrid is None:
            return None
        fresh = [item.request.state_slot for item in scheduled if item.start == 0]
        if fresh:
            self.hybrid.state.reset(fresh)
        slots = [item.request.state_slot for item in scheduled]
        return to_tensor(slots, torch.long, self.device)

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of the out rows, and the aux rows of every row when asked for."""
        embeds = self.model.embed(step.input_ids)
        kw = place(embeds, step.mm_rows)
        if step.last_seen is not None:
            kw["last_seen"] = step.last_seen
        if step.state_slots is not None:
            kw["state_slots"] = step.state_slots
        pos = step.positions if step.rope_positions is None else step.rope_positions
        if not self.aux_layers:
            return self.model(pos, embeds, self.layers, step.attn, step.out_rows, **kw), None
        hidden, aux = self.model(pos, embeds, self.layers, step.attn, None, self.aux_layers, **kw)
        if step.out_rows is not None:
            hidden = hidden.index_select(0, step.out_rows.rows)
        return hidden, aux

    @torch.inference_mode()
    def execute(self, scheduled) -> StepOutput:
        if not scheduled:
            return StepOutput({}, {})
        step = self.prepare(scheduled)
        grammars = [r.grammar for r in step.sampling if r.grammar is not None]
        # The grammars' masks are computed on their own thread while the forward runs.
        masks = start_masks(grammars) if grammars else None
        hidden, _ = self._forward(step)
        if not step.sampling:
            return StepOutput({}, {})
        ids = [r.request_id for r in step.sampling]
        if all(plain_greedy(r) for r in step.sampling):  # the logits' argmax is all it needs
            tokens = self.model.greedy_tokens(hidden)
            return StepOutput(dict(zip(ids, tokens.tolist(), strict=True)), {})
        if masks is not None and all(plain_greedy(r, masked=True) for r in step.sampling):
            tokens = self._greedy_masked(step.sampling, hidden, masks.result())
            return StepOutput(dict(zip(ids, tokens.tolist(), strict=True)), {})
        logits = self.model.compute_logits(hidden)
        seeds = [self.seeds.get(r.request_id, 0) for r in step.sampling]
        tokens, lps = sample(logits, step.sampling, seeds, self.backend, masks)
        sampled = dict(zip(ids, tokens.tolist(), strict=True))
        logprobs = {rid: lp for rid, lp in zip(ids, lps, strict=True) if lp is not None}
        return StepOutput(sampled, logprobs)

    def _greedy_masked(self, reqs, hidden: torch.Tensor, forbidden: torch.Tensor):
        """Greedy rows, some under a grammar, without the full logits where they can be
        spared. A grammar allowing few tokens (a key, a number, the structure of JSON;
        one when the text is forced) scores just those; one allowing many (inside a
        string) takes the fast argmax when the grammar allows it, as it is then the
        masked argmax too. Only the rows left pay for their full logits."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        allowed = ~forbidden
        counts = allowed.sum(dim=1).tolist()
        narrow = {rows[j]: j for j, c in enumerate(counts) if 0 < c <= _NARROW_MASK}
        fast = [i for i in range(len(reqs)) if i not in narrow]
        tokens = torch.zeros(len(reqs), dtype=torch.long)
        if fast:
            picked = self.model.greedy_tokens(hidden.index_select(0, _index(fast, hidden)))
            tokens[fast] = picked.cpu()
        if narrow:
            tokens[list(narrow)] = self._narrow_argmax(
                hidden, list(narrow), allowed[list(narrow.values())]
            )
        wide = [j for j, i in enumerate(rows) if i not in narrow]
        refused = [j for j in wide if forbidden[j, tokens[rows[j]]]]
        if refused:
            redo = [rows[j] for j in refused]
            logits = self.model.compute_logits(hidden.index_select(0, _index(redo, hidden)))
            apply_masks(logits, list(range(len(redo))), forbidden[refused])
            tokens[redo] = logits.argmax(dim=-1).cpu()
        for i in rows:
            reqs[i].grammar.accept(int(tokens[i]))
        return tokens

    def _narrow_argmax(self, hidden, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
        """The argmax over each row's few allowed tokens, all rows at once: one score per
        (row, allowed token), the best per row, the lowest id among equals (argmax's)."""
        row, ids = allowed.nonzero(as_tuple=True)  # row-major: ids ascend within a row
        h = hidden.index_select(0, _index(rows, hidden)).index_select(0, row.to(hidden.device))
        scores = self.model.pair_logits(h, ids).cpu()
        best = torch.full((len(rows),), float("-inf")).scatter_reduce(0, row, scores, "amax")
        place = torch.where(scores == best[row], torch.arange(len(ids)), len(ids))
        first = torch.full((len(rows),), len(ids)).scatter_reduce(0, row, place, "amin")
        return ids[first]

    @torch.inference_mode()
    def execute_verify(self, scheduled) -> VerifyOutput:
        """A step whose requests may carry drafts (spec/verify.py): each sampling request
        emits its accepted drafts and the target's token; aux rows of the accepted
        positions are kept for the proposer."""
        out = VerifyOutput({}, {})
        if not scheduled:
            return out
        step = self.prepare(scheduled)
        hidden, aux = self._forward(step)
        if step.sampling:
            tokens, lps = self._sample_rows(step, hidden)
            i = 0
            for req, drafts in zip(step.sampling, step.drafts, strict=True):
                rows, lp = tokens[i : i + len(drafts) + 1], lps[i : i + len(drafts) + 1]
                n = num_accepted(drafts, rows) + 1
                out.tokens[req.request_id] = rows[:n]
                for token in rows[:n] if req.grammar is not None else ():
                    req.grammar.accept(token)
                if lp[0] is not None:
                    out.logprobs[req.request_id] = lp[:n]
                i += len(drafts) + 1
        if aux is not None:
            self._keep_aux(step, aux, out.tokens)
        return out

    def _sample_rows(self, step: StepInputs, hidden: torch.Tensor):
        """Token (and logprobs or None) of every out row: row i of a request as a plain
        step at its position would draw it."""
        if all(plain_greedy(r) for r in step.sampling):
            return self.model.greedy_tokens(hidden).tolist(), [None] * hidden.shape[0]
        rows, seeds, masked = [], [], []
        for req, drafts in zip(step.sampling, step.drafts, strict=True):
            req_rows = verify_rows(req, drafts)
            if req.grammar is not None:  # its masks along the drafts, applied here
                req_rows[0] = verify_row(req, [])
                masked.append((len(rows), req.grammar.masks_along(drafts)))
            rows.extend(req_rows)
            seeds.extend([self.seeds.get(req.request_id, 0)] * (len(drafts) + 1))
        logits = self.model.compute_logits(hidden)
        for start, forbidden in masked:
            apply_masks(logits, list(range(start, start + len(forbidden))), forbidden)
        tokens, lps = sample(logits, rows, seeds, self.backend)
        return tokens.tolist(), lps

    def _keep_aux(self, step: StepInputs, aux: torch.Tensor, emitted: dict[str, list[int]]):
        """Queue each request's aux rows of positions whose tokens are now known: all of
        a prefill chunk; of a verification, the last known token and accepted drafts."""
        sampled_drafts = {
            r.request_id: len(d) for r, d in zip(step.sampling, step.drafts, strict=True)
        }
        for rid, row0, n in step.spans:
            k = sampled_drafts.get(rid, 0)
            keep = n - k + (len(emitted.get(rid, [])) - 1 if rid in emitted else 0)
            if keep > 0:
                self.aux_rows.setdefault(rid, []).append(aux[row0 : row0 + keep])

    @torch.inference_mode()
    def execute_burst(self, scheduled, steps: int) -> dict[str, list[int]]:
        """``steps`` greedy decode steps of a pure decode batch (every request plain
        greedy, its block table covering ``steps`` new tokens): the tokens of each request.

        One backend call when the backend can (``decode_greedy``), else a loop of
        ordinary steps here; both give what ``steps`` calls of ``execute`` would.
        """
        step = self.prepare(scheduled)
        ids = [item.request.request_id for item in scheduled]
        tokens = self.model.decode_greedy(
            step.input_ids, step.positions, self.layers, step.attn, steps
        )
        if tokens is None:
            tokens = self._burst_loop(step, steps)
        return dict(zip(ids, tokens.t().tolist(), strict=True))

    def _burst_loop(self, step: StepInputs, steps: int) -> torch.Tensor:
        tokens, pos, meta = step.input_ids, step.positions, step.attn
        rope = pos if step.rope_positions is None else step.rope_positions  # [T]: decode
        kw = {} if step.state_slots is None else {"state_slots": step.state_slots}
        out = []
        for s in range(steps):
            if s:
                pos, rope = pos + 1, rope + 1
                meta = next_decode_meta(meta, pos, self.block_size)
            hidden = self.model(rope, self.model.embed(tokens), self.layers, meta, None, **kw)
            tokens = self.model.greedy_tokens(hidden)
            out.append(tokens)
        return torch.stack(out)


# A grammar that allows at most this many tokens is scored on just those (a gathered
# GEMV: cheaper than the whole head below this; JSON's structure allows a handful).
_NARROW_MASK = 256


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=like.device)


def plain_greedy(req: Request, masked: bool = False) -> bool:
    """Greedy with no logprobs and nothing that edits the logits (penalties, min_tokens,
    a grammar unless ``masked``, a forced end of thinking)."""
    sp = req.sampling_params
    return (
        sp.greedy
        and (masked or sp.structured_outputs is None)
        and forced_token(req) is None
        and sp.logprobs is None
        and not sp.has_penalties
        and req.num_output_tokens >= sp.min_tokens
    )
