"""Deduplicate concurrent work: callers asking for the same key share one computation.

In-process only: concurrent requests for one image in this process encode it once.
(Across processes the embedding store makes repeats cheap: the second process hits.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """Runs at most one computation per key at a time; every caller gets its result.

    A caller that is cancelled stops waiting, but the computation keeps running for
    the others (it is shielded). The computation's exception reaches every waiter.
    The key is forgotten once the computation finishes, so later calls compute again
    (cache the result yourself, e.g. in the embedding store).
    """

    def __init__(self) -> None:
        """An empty group."""
        self._inflight: dict[K, asyncio.Task[V]] = {}
        self._waiters: dict[K, int] = {}

    def inflight(self, key: K) -> bool:
        """True while a computation for ``key`` runs."""
        return key in self._inflight

    def waiters(self, key: K) -> int:
        """Callers now waiting for ``key``'s computation."""
        return self._waiters.get(key, 0)

    async def do(self, key: K, fn: Callable[[], Awaitable[V]]) -> V:
        """Return ``await fn()``, sharing the call with concurrent callers of ``key``."""
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(fn())
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._finished(k, t))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)
        finally:
            left = self._waiters.pop(key) - 1
            if left:
                self._waiters[key] = left

    def _finished(self, key: K, task: asyncio.Task[V]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled() and task.exception() is not None:
            # Marks the exception retrieved even when every waiter was cancelled.
            logger.debug("singleflight %r failed: %r", key, task.exception())
