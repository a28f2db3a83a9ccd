"""What one scheduler step hands to the model runner (plain dataclasses, torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens ``start .. start + num_new_tokens``.

    ``request.block_ids`` already covers those tokens when the step is handed out.
    """

    request: Request
    num_new_tokens: int
    # request.num_computed_tokens when scheduled: position of the first new token.
    start: int
    # True when this step reaches the last known token, so the runner samples the next
    # one; a non-final chunk of a prefill produces no token.
    sample: bool
    # Speculative decoding: the draft tokens verified this step; they are the last
    # ``len(draft_token_ids)`` of the ``num_new_tokens`` (the first is the request's last
    # known token), and the runner samples at every one of those 1 + k positions.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end(self) -> int:
        """Tokens computed once this step has run."""
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """The batch of one engine step, in order: running requests, then newly admitted."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests pushed back to waiting this step; their KV is gone (recompute on return).
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished or aborted since the previous step: drop per-request state.
    finished_ids: list[str] = field(default_factory=list)
    # Decode steps this batch runs at once (> 1: a burst, see Scheduler.schedule); every
    # scheduled request then has one new token and block room for num_steps.
    num_steps: int = 1

    @property
    def total_num_tokens(self) -> int:
        """Tokens computed in this step, over all scheduled requests."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (there may still be ids to clean up)."""
        return not self.scheduled
