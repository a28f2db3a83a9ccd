"""Verification of speculative drafts: the target's token at every draft position, then
the longest prefix of drafts it agrees with.

A request with drafts ``d_0 .. d_{k-1}`` computes 1 + k rows in one step; row ``i`` holds
the target's distribution ``p_i`` for the token at output position ``num_tokens + i``,
given the known tokens followed by ``d_0 .. d_{i-1}``. Each row is sampled exactly as a
plain decode step would sample that position (penalties and min_tokens see the drafts
before it as output; random numbers come from (seed, position)): ``t_i``. The request
emits ``t_0 .. t_n`` where ``n`` is the number of leading drafts with ``d_i == t_i``.

Greedy: ``t_i`` is the argmax, so this is "longest matching prefix plus the target's
next token". Sampling: this *is* rejection sampling for a point-mass draft distribution
``q = δ(d_i)`` (every proposer here hands over tokens, not distributions): the draft is
accepted with probability ``p_i(d_i) = min(1, p_i(d_i) / q(d_i))``, and on rejection the
emitted ``t_i`` is distributed as ``p_i`` conditioned on ``t_i != d_i``, i.e.
``norm(max(0, p_i - q))``. So the output distribution is exactly the target's, whatever
proposed the drafts, and because ``t_i`` is the token a run without drafts would draw at
that position from the same (seed, position), a seeded request emits the very same tokens
with and without speculation, in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.request import Request
from services.engine.thinking import ThinkingBudget
from services.sampling_params import SamplingParams


@dataclass
class DraftRow:
    """The request as row ``i`` of its verification sees it: drafts ``d_0 .. d_{i-1}``
    appended as if already generated (what ``sample`` reads of a Request)."""

    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    all_token_ids: list[int]
    output_token_ids: list[int]
    # Row 0 of a constrained request keeps its thinking budget (a budget still running
    # has no drafts, so no other row needs it).
    thinking: ThinkingBudget | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def verify_rows(req: Request, drafts: list[int]) -> list[Request | DraftRow]:
    """The 1 + len(drafts) sampling rows of one request, in order (row 0 is ``req``)."""
    return [req, *(verify_row(req, drafts[:i]) for i in range(1, len(drafts) + 1))]


def verify_row(req: Request, drafts: list[int]) -> DraftRow:
    """``req`` with ``drafts`` appended as if generated (no grammar: a constrained
    request's masks along its drafts are applied by the caller)."""
    known, out = req.all_token_ids, req.output_token_ids
    thinking = None if drafts else req.thinking
    return DraftRow(req.sampling_params, req.eos_token_ids, known + drafts, out + drafts, thinking)


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n
