"""What a serving backend (aggregated engine or the E/P/D fleet) streams to the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.sampler import TokenLogprobs
from services.outputs import RequestOutput
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


def event_from_output(out: RequestOutput, sent_logprobs: int, n_logprobs: int) -> TokenEvent:
    comp = out.outputs[0]
    new = comp.token_ids_delta
    lps: list[TokenLogprobs | None] = [None] * len(new)
    if comp.logprobs is not None:
        tail = comp.logprobs[sent_logprobs : sent_logprobs + len(new)]
        lps = [logprobs_from_dict(t, d, n_logprobs) for t, d in zip(new, tail, strict=False)]
    return TokenEvent(list(new), lps, comp.finish_reason, comp.stop_reason, out.num_cached_tokens)
