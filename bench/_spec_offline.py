"""Acceptance measured without the engine: a proposer's drafts against the target's own
greedy continuation, replayed step by step as a greedy speculative decoder would.

For each prompt the target's greedy continuation and its hidden rows (one transformers
forward over prompt + continuation) are computed once. Then, from the end of the prompt:
the proposer drafts k tokens from what a real engine would have given it (the rows of the
newly accepted positions), the longest prefix equal to the continuation is accepted plus
the target's own next token, and the proposer gets those positions' rows next time.
The mean of (accepted + 1) per verification is the mean acceptance length; it is exact for
greedy decoding (the engine emits precisely this continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from _spec_heads import target_rows

from services.engine.spec.proposer import ProposeInput


@dataclass
class Reference:
    """One prompt's greedy continuation and the target rows along it."""

    prompt: list[int]
    continuation: list[int]
    rows: torch.Tensor  # [len(prompt + continuation), naux * H]: rows at every position


@dataclass
class Acceptance:
    """Verifications replayed and what they accepted."""

    verifications: int = 0
    emitted: int = 0  # accepted drafts + one target token per verification
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    @property
    def mean_length(self) -> float:
        return self.emitted / self.verifications if self.verifications else 0.0

    def by_position(self) -> list[float]:
        return [
            round(a / d, 3) if d else 0.0
            for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
        ]

    def add(self, drafts: list[int], truth: list[int]) -> int:
        """Score one verification; returns how many tokens it emitted."""
        n = 0
        while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
            n += 1
        grow = len(drafts) - len(self.drafted_by_position)
        self.drafted_by_position += [0] * max(0, grow)
        self.accepted_by_position += [0] * max(0, grow)
        for i in range(len(drafts)):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < n
        self.verifications += 1
        self.emitted += n + 1
        return n + 1


@torch.no_grad()
def references(target, prompts: list[list[int]], new: int, aux_ids) -> list[Reference]:
    """Greedy continuations of ``new`` tokens (transformers) and the rows along them."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=target.config.pad_token_id,
        )
        rows = target_rows(target, gen, aux_ids)[0][0]
        out.append(Reference(p, gen[0, len(p) :].tolist(), rows))
    return out


def replay(proposer, refs: list[Reference], k: int) -> Acceptance:
    """Replay greedy speculative decoding of every reference with ``proposer``."""
    acc = Acceptance()
    for i, ref in enumerate(refs):
        rid = f"offline-{i}"
        full = ref.prompt + ref.continuation
        done = 1  # the target's first token comes from the prefill, not a draft
        given = 0  # rows the proposer has: positions [0, given)
        while done < len(ref.continuation):
            known = len(ref.prompt) + done
            rows = ref.rows[given : known - 1] if proposer.aux_layers else None
            drafts = proposer.propose([ProposeInput(rid, full[:known], rows)], k)[0]
            given = known - 1
            done += acc.add(drafts, ref.continuation[done : done + k])
        proposer.free(rid)
    return acc
