"""Micro-batching: items that arrive while a batch runs share the next one.

An idle batcher starts a batch at once (after ``window_s``, 0 by default: a fixed wait
only adds latency when load is light); while a batch runs in a worker thread, new items
queue up and go together in the next one, so batches grow exactly when load does. The
encoder's tower (encoder_svc, and ``serve all``'s in-process encoder) and the semantic
cache's sentence embedder both batch through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """``await submit(item)`` -> its result; ``run`` maps a batch of items to as many
    results and runs in a worker thread (the event loop keeps serving). When ``run``
    raises, every item of that batch gets the exception: nobody waits forever."""

    def __init__(
        self,
        run: Callable[[list[T]], Sequence[R]],
        *,
        max_batch: int = 32,
        window_s: float = 0.0,
        observe: Callable[[int], None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.run = run
        self.max_batch = max_batch
        self.window_s = window_s
        self.observe = observe  # called with each batch's size (a histogram's observe)
        self._pending: list[tuple[T, asyncio.Future]] = []
        self._busy = False
        self._tasks: set[asyncio.Task] = set()
        # Batches finished (the encoder's heartbeats carry it: a moving count is a busy
        # encoder, so the gateway waits on a long queue there instead of failing it over).
        self.batches = 0

    @property
    def waiting(self) -> int:
        """Items queued for a later batch."""
        return len(self._pending)

    async def submit(self, item: T) -> R:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        self._start()
        return await fut

    def _start(self) -> None:
        if self._busy or not self._pending:
            return
        self._busy = True
        task = asyncio.create_task(self._run_next())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_next(self) -> None:
        try:
            if self.window_s:
                await asyncio.sleep(self.window_s)
            batch = self._pending[: self.max_batch]
            self._pending = self._pending[self.max_batch :]
            if self.observe is not None:
                self.observe(len(batch))
            try:
                results = await asyncio.to_thread(self.run, [item for item, _ in batch])
            except Exception as e:  # every waiter learns why; nobody hangs
                log.warning("batch of %d failed: %s", len(batch), e)
                results = [e] * len(batch)
            self.batches += 1
            for (_, fut), result in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
        finally:
            self._busy = False
            self._start()  # what queued up during this batch goes next, together
