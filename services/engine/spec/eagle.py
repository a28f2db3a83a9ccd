"""EAGLE-3 and P-EAGLE draft proposers over an ``Eagle3Head`` (the engine's ``Proposer``).

Per request the proposer keeps the draft layer's K/V of the positions whose target hidden
rows it was given ("committed" entries), densely, in one growing buffer. Each ``propose``:

1. drops whatever was drafted last time (and anything at or after the first new row's
   position: the engine re-delivers rows after a preemption or never for rejected
   drafts), then runs the head over the new rows, all requests in one padded forward;
2. EAGLE-3: the last row's output gives draft 1; drafts 2..k each take one more forward
   of the whole batch, fed with the previous draft's embedding and the head's own output
   as the feature (autoregressive: k forwards per propose);
   P-EAGLE (``parallel=True``): k-1 extra rows ride along in the first forward, each the
   embedding of the mask token with the learned shared feature ``mask_hidden``, at the
   next positions, so the one forward yields all k drafts.

Drafted K/V is never kept: the accepted tokens come back with the target's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.spec.proposer import ProposeInput
from services.models.eagle3 import Eagle3Head
from services.models.eagle3_config import DraftHeadError


@dataclass
class _DraftKV:
    """One request's committed draft-layer K/V: entry i is at position ``start + i``."""

    k: torch.Tensor  # [kvh, capacity, d]
    v: torch.Tensor  # [kvh, capacity, d]
    start: int  # the position of entry 0
    length: int = 0  # committed entries

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append [kvh, t, d] entries, doubling the buffer when full."""
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            grow = max(end, 2 * self.k.shape[1])
            self.k = _grow(self.k, grow)
            self.v = _grow(self.v, grow)
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.length = end


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    out = t.new_zeros(t.shape[0], size, t.shape[2])
    out[:, : t.shape[1]] = t
    return out


@dataclass
class _Batch:
    """The padded first forward of one ``propose`` (B requests)."""

    tokens: torch.Tensor  # [B, T] target ids of the new rows (then mask tokens)
    feats: torch.Tensor  # [B, T, H] fc(target rows) (then P-EAGLE's mask feature)
    positions: torch.Tensor  # [B, T]
    past_k: torch.Tensor  # [B, kvh, L, d] committed entries, right-padded
    past_v: torch.Tensor  # [B, kvh, L, d]
    key_ok: torch.Tensor  # [B, L + T] bool: which keys hold real entries
    rows: list[int]  # per request, how many of its T rows are real target rows
    last: torch.Tensor  # [B] index of each request's last target row


class Eagle3Proposer:
    """Drafts with an EAGLE-3 head, autoregressively or (P-EAGLE) in one forward."""

    def __init__(self, head: Eagle3Head, parallel: bool):
        if parallel and not head.cfg.parallel:
            raise DraftHeadError(
                "parallel_drafting needs a P-EAGLE head (speculators_model_type 'peagle', "
                "with mask_hidden and mask_token_id); this one is 'eagle3'"
            )
        self.head = head.eval()
        self.parallel = parallel
        self.aux_layers: tuple[int, ...] = head.cfg.aux_layers
        self.forwards = 0  # head forwards run so far (one per P-EAGLE propose)
        self._state: dict[str, _DraftKV] = {}
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def load(
        cls,
        head_dir: str | Path,
        target_config,
        device,
        dtype,
        parallel: bool,
        target_embed: torch.Tensor | None = None,
        backend=None,
    ) -> Eagle3Proposer:
        """Load a Speculators head, check it against the target's config, place it.
        ``backend``: the target's, whose native norm and rotary the head then uses (fp32
        on CPU only, where torch's per-op overhead dominates a one-row draft forward)."""
        head = Eagle3Head.from_pretrained(head_dir, target_embed=target_embed)
        head.cfg.check_target(target_config)
        head = head.to(device=device, dtype=dtype)
        if backend is not None and torch.device(device).type == "cpu" and dtype == torch.float32:
            head.use_backend(backend)
        return cls(head, parallel)

    @property
    def requests(self) -> tuple[str, ...]:
        """The requests whose draft K/V is held."""
        return tuple(self._state)

    def free(self, request_id: str) -> None:
        """Forget the request's draft K/V."""
        self._state.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        """At most ``k`` draft ids per input (none when it brought no new target row)."""
        out: list[list[int]] = [[] for _ in batch]
        live = [
            i for i, x in enumerate(batch) if k > 0 and x.hidden is not None and x.hidden.shape[0]
        ]
        if not live:
            return out
        inputs = [batch[i] for i in live]
        b = self._build(inputs, k)
        drafts = self._draft(inputs, b, k)
        for j, i in enumerate(live):
            out[i] = drafts[j]
        return out

    def _state_for(self, x: ProposeInput, first: int) -> _DraftKV:
        """The request's K/V cut back to the positions before ``first``."""
        st = self._state.get(x.request_id)
        if st is None or not st.start <= first <= st.start + st.length:
            c = self.head.cfg  # new request, or rows past a gap: start over from here
            empty = torch.zeros(
                c.num_kv_heads, 64, c.head_dim, device=self.device, dtype=self.dtype
            )
            st = _DraftKV(empty, empty.clone(), start=first)
            self._state[x.request_id] = st
        st.length = first - st.start
        return st

    def _build(self, inputs: list[ProposeInput], k: int) -> _Batch:
        head, extra = self.head, (k - 1 if self.parallel else 0)
        states, toks, feats, pos, rows = [], [], [], [], []
        fused = self._fuse(inputs, extra > 0)
        for x, f in zip(inputs, fused, strict=False):
            m, n = x.hidden.shape[0], len(x.token_ids)
            states.append(self._state_for(x, n - m))
            t = torch.tensor(x.token_ids[n - m :], device=self.device)
            if extra:  # P-EAGLE: positions n .. n+k-2 are the mask token + shared feature
                t = torch.cat([t, t.new_full((extra,), head.cfg.mask_token_id)])
                f = torch.cat([f, fused[-1].expand(extra, -1)])
            toks.append(t)
            feats.append(f)
            pos.append(torch.arange(n - m, n + extra, device=self.device))
            rows.append(m)
        past_k, past_v, past_ok = _pad_past(states)
        t_max = max(len(t) for t in toks)
        new_ok = torch.zeros(len(inputs), t_max, dtype=torch.bool, device=self.device)
        for i, t in enumerate(toks):
            new_ok[i, : len(t)] = True
        return _Batch(
            tokens=_pad([t for t in toks], t_max),
            feats=_pad(feats, t_max),
            positions=_pad(pos, t_max),
            past_k=past_k,
            past_v=past_v,
            key_ok=torch.cat([past_ok, new_ok], dim=1),
            rows=rows,
            last=torch.tensor([m - 1 for m in rows], device=self.device),
        )

    def _fuse(self, inputs: list[ProposeInput], mask: bool) -> list[torch.Tensor]:
        """fc over every request's new target rows in one matmul (fc's weights are read
        once, not once per request), split back per request; with ``mask``, P-EAGLE's
        ``mask_hidden`` rides along and its feature comes last."""
        hidden = [x.hidden.to(self.device, self.dtype) for x in inputs]
        if mask:
            hidden.append(self.head.mask_hidden.view(1, -1))
        fused = self.head.fuse(torch.cat(hidden))
        return list(fused.split([h.shape[0] for h in hidden]))

    def _draft(self, inputs: list[ProposeInput], b: _Batch, k: int) -> list[list[int]]:
        head, nb = self.head, len(inputs)
        t = b.tokens.shape[1]
        mask = b.key_ok[:, None, None, :] & _causal_tail(b.past_k.shape[2], t, self.device)
        out, new_k, new_v = head.step(b.tokens, b.feats, b.positions, b.past_k, b.past_v, mask)
        self.forwards += 1
        for i, x in enumerate(inputs):  # commit the target rows' entries
            self._state[x.request_id].append(new_k[i, :, : b.rows[i]], new_v[i, :, : b.rows[i]])
        ar = torch.arange(nb, device=self.device)
        if self.parallel:  # the last target row, then the k-1 mask rows after it
            idx = b.last[:, None] + torch.arange(k, device=self.device)[None, :]
            return head.greedy(out[ar[:, None], idx])[0].tolist()
        tok, feat = head.greedy(out[ar, b.last])
        drafts = [tok]
        keys_k = torch.cat([b.past_k, new_k], dim=2)
        keys_v = torch.cat([b.past_v, new_v], dim=2)
        ok = b.key_ok  # the padding after each request's last row stays masked
        pos = b.positions[ar, b.last]
        for _ in range(k - 1):
            pos = pos + 1
            ok = torch.cat([ok, ok.new_ones(nb, 1)], dim=1)
            o, nk, nv = head.step(
                tok[:, None], feat[:, None], pos[:, None], keys_k, keys_v, ok[:, None, None, :]
            )
            self.forwards += 1
            keys_k, keys_v = torch.cat([keys_k, nk], 2), torch.cat([keys_v, nv], 2)
            tok, feat = head.greedy(o[:, 0])
            drafts.append(tok)
        return torch.stack(drafts, dim=1).tolist()


def _pad(rows: list[torch.Tensor], size: int) -> torch.Tensor:
    """Right-pad [t, ...] tensors to [B, size, ...] with zeros."""
    out = rows[0].new_zeros((len(rows), size, *rows[0].shape[1:]))
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _pad_past(states: list[_DraftKV]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committed K/V of every request right-padded to the longest: [B, kvh, L, d] x 2 and
    which of the L keys are real [B, L]."""
    longest = max(s.length for s in states)
    kvh, _, d = states[0].k.shape
    ref = states[0].k
    pk = ref.new_zeros(len(states), kvh, longest, d)
    pv = ref.new_zeros(len(states), kvh, longest, d)
    ok = torch.zeros(len(states), longest, dtype=torch.bool, device=ref.device)
    for i, s in enumerate(states):
        pk[i, :, : s.length] = s.k[:, : s.length]
        pv[i, :, : s.length] = s.v[:, : s.length]
        ok[i, : s.length] = True
    return pk, pv, ok


def _causal_tail(past: int, t: int, device) -> torch.Tensor:
    """[t, past + t] bool: every query sees all past keys and the new ones up to itself."""
    new = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(t, past, dtype=torch.bool, device=device), new], dim=1)
