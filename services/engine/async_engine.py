"""The asyncio face of the engine: one engine thread, per-request output streams.

Model steps run in a dedicated thread (torch releases the GIL in its kernels), so the
event loop keeps serving the bus and clients while a step computes. Every engine call
is made from that thread; the loop talks to it through a command queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.engine.llm_engine import LLMEngine
from services.outputs import RequestOutput

log = logging.getLogger(__name__)

# Put in a stream's queue when its deadline passes.
_EXPIRED = object()


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (unix time, as clients send it; None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.time())


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    """Wraps an ``LLMEngine``: ``generate`` yields incremental outputs; ``abort`` cancels."""

    def __init__(
        self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None] | None = None
    ):
        """``on_outputs``, when given, receives every step's outputs on the event loop
        (services batch them per destination) instead of per-request streams."""
        self.engine = engine
        self._on_outputs = on_outputs
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Engine steps finished (heartbeats carry it: a moving count is a busy engine).
        self.steps = 0

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="epd-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Abort what is in flight and stop the thread; safe to call twice."""
        if self._thread is None or self._stopping:
            return
        for rid in list(self._streams):
            self._cmds.put((lambda r=rid: self.engine.abort_request(r), None))
        self._stopping = True
        self._cmds.put((None, None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, grace_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- calls ------------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def stream(
        self, request_id: str, add: Callable[[], Any], deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Register an output stream, add the request with ``add``, yield its outputs.
        ``deadline`` (unix time): past it the stream raises ``TimeoutError`` (and the
        request is aborted); one timer for the whole stream, not one per output."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        finished = False
        expiry = None
        try:
            async with asyncio.timeout(_left(deadline)):
                await self.call(add)
            if deadline is not None:
                expiry = asyncio.get_running_loop().call_later(
                    _left(deadline), q.put_nowait, _EXPIRED
                )
            while True:
                item = await q.get()
                if item is _EXPIRED:
                    raise TimeoutError(f"request {request_id} ran past its deadline")
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if expiry is not None:
                expiry.cancel()
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                self._cmds.put((lambda: self.engine.abort_request(request_id), None))

    def generate(
        self, request_id: str, prompt, params=None, deadline: float | None = None, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        return self.stream(
            request_id,
            lambda: self.engine.add_request(request_id, prompt, params, **kwargs),
            deadline,
        )

    async def abort(self, request_id: str) -> None:
        if self.alive:
            await self.call(lambda: self.engine.abort_request(request_id))

    def load(self) -> dict[str, int]:
        """Running / waiting requests, free KV blocks and steps finished (read racily,
        for heartbeats)."""
        s, bm = self.engine.scheduler, self.engine.block_manager
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
            "steps": self.steps,
        }

    # -- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except Exception as e:  # pragma: no cover - last resort: never hang the callers
            log.exception("engine thread died")
            self._fail_all(EngineDeadError(f"engine failed: {e}"))
        finally:
            self._stopping = True
            # Streams still open will get no more outputs: tell them instead of hanging.
            self._fail_all(EngineDeadError("the engine stopped before the request finished"))

    def _drain(self, block: bool) -> bool:
        """Run pending commands; False when asked to stop."""
        while True:
            try:
                fn, fut = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
            except queue.Empty:
                return True
            block = False
            if fn is None:
                return False
            # A command runs even when its caller stopped waiting (an abort must not be
            # lost); only the answer is dropped then.
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            if fut is None or fut.cancelled():
                if error is not None:
                    log.warning("engine command failed: %s", error)
                continue
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled just now
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the running requests")
            self._abort_everything(e)
            return
        self.steps += 1
        if not outputs or self._loop is None:
            return
        # One wake-up of the loop a step, not one an output: at 64 running requests the
        # per-output handles were a measurable share of the loop's time.
        self._loop.call_soon_threadsafe(self._on_outputs or self._put_all, outputs)

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        """On the loop: each output to its request's stream (gone streams are skipped)."""
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _abort_everything(self, error: Exception) -> None:
        failed = []
        for rid in self.engine.request_ids():
            out = self.engine.abort_request(rid)
            if out is not None:
                out.error = f"engine step failed: {error}"
                failed.append(out)
            self._deliver(rid, RuntimeError(f"engine step failed: {error}"))
        if self._on_outputs is not None and self._loop is not None and failed:
            self._loop.call_soon_threadsafe(self._on_outputs, failed)

    def _deliver(self, request_id: str, item) -> None:
        q = self._streams.get(request_id)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._streams):
            self._deliver(rid, error)
