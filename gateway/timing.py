"""One request's metrics at the gateway: outcome, TTFT, inter-token gaps, TPOT, end to
end, tokens (services/metrics.py defines them)."""

from __future__ import annotations

import asyncio
import time

from gateway.events import BackendError
from gateway.prepare import InvalidRequest, ModelNotFoundError
from services.metrics import (
    E2E,
    GENERATED_TOKENS,
    INTER_TOKEN,
    PROMPT_TOKENS,
    REQUESTS,
    TPOT,
    TTFT,
)


def outcome_of(e: BaseException) -> str:
    """The ``outcome`` label of a request that ended with ``e`` (a fixed, small set)."""
    if isinstance(e, BackendError):
        return e.code.lower()
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        return "cancelled"  # the client went away
    if isinstance(e, ModelNotFoundError):
        return "not_found"
    if isinstance(e, InvalidRequest | ValueError | TypeError):
        return "invalid_argument"
    return "internal"


class RequestTimer:
    """Created when a request starts running; ``streamed`` per update with tokens,
    ``finished`` once."""

    def __init__(self, prompt_tokens: int, choices: int) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: list[float | None] = [None] * choices
        self.tokens = 0
        PROMPT_TOKENS.inc(prompt_tokens)

    def streamed(self, index: int, num_tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            TTFT.observe(now - self.start)
        last = self.last[index]
        if last is not None:
            INTER_TOKEN.observe((now - last) / num_tokens)
        self.last[index] = now
        self.tokens += num_tokens
        GENERATED_TOKENS.inc(num_tokens)

    def finished(self, outcome: str) -> float:
        """Count the request; on success observe end to end and TPOT. Returns the
        seconds it took."""
        now = time.perf_counter()
        REQUESTS.labels(outcome).inc()
        if outcome == "ok":
            E2E.observe(now - self.start)
            per_choice = self.tokens / len(self.last)
            if self.first is not None and per_choice > 1:
                TPOT.observe((now - self.first) / (per_choice - 1))
        return now - self.start
