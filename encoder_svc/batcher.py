"""Micro-batching: images that arrive within a short window share one tower pass."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from services.metrics import ENCODE_BATCH

log = logging.getLogger(__name__)


class EncodeBatcher:
    """``submit(image)`` -> its embedding; ``encode_fn`` runs batches in a worker thread."""

    def __init__(self, encode_fn: Callable[[list[bytes]], list[torch.Tensor]],
                 window_s: float, max_batch: int = 32):  # fmt: skip
        self.encode_fn = encode_fn
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[bytes, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        # One tower pass at a time: torch already uses every core for one batch.
        self._lock = asyncio.Lock()

    async def submit(self, image: bytes) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((image, fut))
        if len(self._pending) >= self.max_batch:
            self._dispatch()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._dispatch)
        return await fut

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[bytes, asyncio.Future]]) -> None:
        async with self._lock:
            ENCODE_BATCH.observe(len(batch))
            try:
                out = await asyncio.to_thread(self.encode_fn, [img for img, _ in batch])
            except Exception as e:  # every waiter learns why; nobody hangs
                log.warning("encoder batch failed: %s", e)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                return
        for (_, fut), emb in zip(batch, out, strict=True):
            if not fut.done():
                fut.set_result(emb)
