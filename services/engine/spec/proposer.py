"""The draft-proposer interface of speculative decoding (n-gram, EAGLE-3, P-EAGLE).

Each engine step, before scheduling, the engine asks the proposer for up to ``k`` draft
tokens per running decode request; the scheduler schedules ``1 + len(drafts)`` tokens for
it and the target model verifies them all in one forward over the paged KV cache
(spec/verify.py). A proposer is plain Python over token ids (n-gram) or runs its own
small model (an EAGLE head, spec/eagle.py) fed with the target's hidden states.

Contract:

* ``aux_layers``: indices (0-based) of the target decoder layers whose *outputs* the
  proposer needs; ``()`` for proposers that need none (n-gram). When it is non-empty,
  the target captures those layers' outputs at every computed position, and only then
  (no cost otherwise).
* ``propose(batch, k)``: one list of at most ``k`` draft token ids per ``ProposeInput``,
  in batch order. Fewer (or none) is fine: that request then verifies fewer tokens.
  ``k`` is ``num_speculative_tokens``; the engine cuts a request's drafts further near
  its ``max_tokens`` / context limit, and at the first id outside the vocabulary.
* ``free(request_id)``: the request finished, was aborted or preempted: drop any state
  kept for it. After a preemption the request is recomputed, and the engine delivers the
  recomputed hidden rows again (from position 0, or from the end of the prefix-cache
  hit) at the next ``propose``.

Hidden rows: each ``ProposeInput.hidden`` carries the rows the engine has computed for
that request since the last ``propose`` (accumulated over chunked-prefill chunks; after
a verification step, the rows of the positions whose tokens were accepted, never those of
rejected drafts). Row ``j`` is the target's hidden state at position
``len(token_ids) - 1 - m + j`` (``m = hidden.shape[0]``), i.e. the state computed *from*
token ``token_ids[-1 - m + j]``, the one that predicted ``token_ids[-m + j]``. So the last
row is the state that predicted ``token_ids[-1]``, the newest token (whose own state is
not computed yet: it is the first token of the next verify step). After a verify step
that accepted ``a`` drafts, ``m == a + 1``. An EAGLE head keeps the rows it was given
before. Positions a prefix-cache hit skipped are never delivered (the head starts from
what it gets); in the fleet, a decode instance gets the rows the prefill instance sent
with the KV (at least the last prompt position's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ProposeInput:
    """One request's view for one ``propose`` call."""

    request_id: str
    # Every known token of the request: prompt + accepted output (the newest last).
    token_ids: list[int]
    # [m, len(aux_layers) * hidden_size], target dtype and device: outputs of the layers
    # in ``aux_layers``, concatenated in that order along the last dim, at the m
    # positions just before the last token (of token_ids[-1-m:-1]); None when
    # ``aux_layers`` is empty.
    hidden: torch.Tensor | None


@runtime_checkable
class Proposer(Protocol):
    """What the engine needs from a draft proposer (see the module docstring)."""

    # Target decoder layers (0-based) whose outputs the proposer needs; () for n-gram.
    aux_layers: tuple[int, ...]

    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        """At most ``k`` draft token ids per input, in batch order."""
        ...

    def free(self, request_id: str) -> None:
        """Forget the request (finished, aborted or preempted)."""
        ...
