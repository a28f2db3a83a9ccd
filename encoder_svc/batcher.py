"""Micro-batching: images that arrive while the tower is busy share its next pass.

An idle encoder starts a pass at once (after ``window_s``, 0 by default: a fixed wait
only adds latency when load is light); while a pass runs, new images queue up and go
together in the next one, so batches grow exactly when load does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
from PIL import Image

from services.metrics import ENCODE_BATCH

log = logging.getLogger(__name__)


class EncodeBatcher:
    """``submit(image)`` -> its embedding; ``encode_fn`` runs batches in a worker thread."""

    def __init__(self, encode_fn: Callable[[list[Image.Image]], list[torch.Tensor]],
                 window_s: float = 0.0, max_batch: int = 32):  # fmt: skip
        self.encode_fn = encode_fn
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[Image.Image, asyncio.Future]] = []
        self._busy = False
        self._tasks: set[asyncio.Task] = set()
        # Tower passes finished (heartbeats carry it: a moving count is a busy encoder,
        # so the gateway waits on a long queue here instead of failing it over).
        self.batches = 0

    @property
    def waiting(self) -> int:
        """Images queued for a later pass."""
        return len(self._pending)

    async def submit(self, image: Image.Image) -> torch.Tensor:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((image, fut))
        if not self._busy:
            self._start()
        return await fut

    def _start(self) -> None:
        if self._busy or not self._pending:
            return
        self._busy = True
        task = asyncio.create_task(self._run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        try:
            if self.window_s:
                await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            ENCODE_BATCH.observe(len(batch))
            try:
                out = await asyncio.to_thread(self.encode_fn, [img for img, _ in batch])
            except Exception as e:  # every waiter learns why; nobody hangs
                log.warning("encoder batch failed: %s", e)
                out = [e] * len(batch)
            self.batches += 1
            for (_, fut), emb in zip(batch, out, strict=True):
                if fut.done():
                    continue
                if isinstance(emb, Exception):
                    fut.set_exception(emb)
                else:
                    fut.set_result(emb)
        finally:
            self._busy = False
            self._start()  # what queued up during this pass goes next, together
