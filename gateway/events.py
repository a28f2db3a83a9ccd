"""What a serving backend (aggregated engine or the E/P/D fleet) streams to the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.outputs import RequestOutput, TokenLogprobs
from services.wire import logprobs_from_dict


class BackendError(Exception):
    """A failure with a status: ``code`` is a grpc.StatusCode name (e.g. "UNAVAILABLE")."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class TokenEvent:
    """New tokens of one request (in order), and how it ended if it did."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Which choice of an n > 1 request these tokens belong to.
    index: int = 0


def events_from_output(out: RequestOutput, n_logprobs: int) -> list[TokenEvent]:
    """One event per choice that changed in an engine output (its deltas)."""
    events = []
    for comp in out.outputs:
        new = comp.token_ids_delta
        lps: list[TokenLogprobs | None] = [None] * len(new)
        if comp.logprobs is not None:
            tail = comp.logprobs[len(comp.token_ids) - len(new) :]
            lps = [logprobs_from_dict(t, d, n_logprobs) for t, d in zip(new, tail, strict=False)]
        events.append(
            TokenEvent(
                list(new),
                lps,
                comp.finish_reason,
                comp.stop_reason,
                out.num_cached_tokens,
                comp.index,
            )
        )
    return events
