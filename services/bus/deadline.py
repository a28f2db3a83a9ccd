"""Deadlines as absolute unix milliseconds (what travels in messages) and timeouts."""

from __future__ import annotations

import time

from services.bus.errors import BusTimeout


def now_unix_ms() -> int:
    """Wall-clock time in unix milliseconds."""
    return time.time_ns() // 1_000_000


def deadline_after(timeout_s: float) -> int:
    """The unix-ms deadline ``timeout_s`` seconds from now."""
    return now_unix_ms() + int(timeout_s * 1000)


def remaining_s(deadline_unix_ms: int) -> float:
    """Seconds left until the deadline (negative once it has passed)."""
    return (deadline_unix_ms - now_unix_ms()) / 1000.0


def timeout_for(deadline_unix_ms: int, what: str, cap_s: float | None = None) -> float:
    """Seconds a wait may take before the deadline, capped; BusTimeout if already past."""
    left = remaining_s(deadline_unix_ms)
    if left <= 0:
        raise BusTimeout(what, 0.0)
    return left if cap_s is None else min(left, cap_s)
