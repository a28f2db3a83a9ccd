"""The protocol-independent gateway: prepare, (cache,) run on a backend, stream deltas.

The gRPC server and the OpenAI app both stand on this: same validation, same limits,
same streams of deltas (one per choice of an n > 1 request), same aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.dashboard.stats import RollingStats
from gateway.events import BackendError, TokenEvent
from gateway.prepare import InvalidRequest, PreparedRequest, RequestPreparer
from gateway.response_cache import ResponseCache, replay
from gateway.stream import Delta, OutputStream
from gateway.timing import RequestTimer, outcome_of
from services.metrics import GATEWAY_CACHE, REQUESTS, REQUESTS_IN_PROGRESS
from services.observability import bind_request

log = logging.getLogger(__name__)

# Requests carrying this much (images, long prompts) are prepared in a worker thread:
# hashing and header checks of megabytes do not belong on the event loop.
_THREAD_PREPARE_BYTES = 256 << 10


# A constraint whose check takes longer than this is refused (a 400): compiling is per
# request, and a pathological schema must not hold a worker (llguidance also bounds the
# work of each mask).
COMPILE_TIMEOUT_S = 10.0


async def within(check, timeout_s: float) -> None:
    """Await ``check``; ValueError when it takes longer than ``timeout_s``."""
    try:
        await asyncio.wait_for(check, timeout_s)
    except TimeoutError as e:
        raise ValueError(f"compiling took longer than {timeout_s:g} s") from e


class ServingBackend(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]: ...
    async def abort(self, prep: PreparedRequest, index: int | None = None) -> None: ...
    def ready(self) -> bool: ...


class GatewayCore:
    """Shared by the gRPC server and the OpenAI app."""

    def __init__(
        self,
        preparer: RequestPreparer,
        backend: ServingBackend,
        config: GatewayConfig | None = None,
        cache: ResponseCache | None = None,
    ):
        self.preparer = preparer
        self.backend = backend
        self.config = config or GatewayConfig()
        self.cache = cache
        self._aborts: set[asyncio.Task] = set()
        self.tokenizer = preparer.tokenizer
        self.info = preparer.info
        self.inflight = 0
        self.stats = RollingStats()  # the last minutes, for GET /dashboard

    async def prepare(self, **kwargs) -> PreparedRequest:
        """RequestPreparer.prepare, in a thread when the request is large. From here on
        the caller's log lines carry the internal request id (the client's is only echoed)."""
        constraint_param = kwargs.pop("constraint_param", "structured_outputs")
        images = kwargs.get("images") or ()
        size = sum(len(im) for im in images) + len(kwargs.get("prompt") or "")
        if kwargs.get("messages") is not None:
            size += _content_size(kwargs["messages"])
        try:
            if size >= _THREAD_PREPARE_BYTES:
                prep = await asyncio.to_thread(lambda: self.preparer.prepare(**kwargs))
            else:
                prep = self.preparer.prepare(**kwargs)
            constraint = prep.params.structured_outputs
            if constraint is not None:  # compiled now: a bad one is a 400 before any work
                try:
                    await within(self.backend.check_constraint(constraint), COMPILE_TIMEOUT_S)
                except ValueError as e:
                    raise InvalidRequest(f"{constraint_param}: {e}", constraint_param) from e
        except Exception as e:
            REQUESTS.labels(outcome_of(e)).inc()
            raise
        bind_request(prep.request_id)
        return prep

    def check_capacity(self) -> None:
        """RESOURCE_EXHAUSTED when this gateway already has max_inflight requests."""
        if self.inflight >= self.config.max_inflight:
            REQUESTS.labels("rejected").inc()
            raise BackendError(
                "RESOURCE_EXHAUSTED",
                f"the server is at capacity ({self.inflight} requests in progress); retry later",
            )

    async def run(self, prep: PreparedRequest) -> AsyncIterator[tuple[Delta, list[OutputStream]]]:
        """Yield (delta, every choice's stream) until every choice finishes: from the
        response cache when it has the answer, else from the backend; abort the request
        on the workers if the consumer stops early, and a choice as soon as a stop string
        ends it here. A finished answer goes to the cache."""
        self.check_capacity()
        bind_request(prep.request_id)
        self.inflight += 1
        REQUESTS_IN_PROGRESS.inc()
        timer, outcome = RequestTimer(len(prep.prompt_token_ids), prep.params.n), "internal"
        streams = [OutputStream(prep, self.tokenizer, i) for i in range(prep.params.n)]
        events, workers = await self._source(prep)
        try:
            async for event in events:
                stream = streams[event.index]
                if stream.finished:
                    continue
                delta = stream.add(event)
                if stream.stopped and workers:
                    await self.backend.abort(prep, stream.index)
                if delta.token_ids:
                    timer.streamed(stream.index, len(delta.token_ids))
                if delta.token_ids or delta.text or delta.finish_reason:
                    yield delta, streams
                if all(s.finished for s in streams):
                    outcome = "ok"
                    if self.cache is not None and workers:
                        self.cache.store(prep, streams)
                    return
            # Accepted work is never lost silently: the client learns it did not finish.
            raise BackendError("UNAVAILABLE", "the workers stopped before the request finished")
        except BaseException as e:
            outcome = outcome_of(e)
            raise
        finally:
            self.inflight -= 1
            REQUESTS_IN_PROGRESS.dec()
            took = timer.finished(outcome)
            log.info("request %s in %.3fs: %d tokens", outcome, took, timer.tokens)
            self.stats.observe_run(
                timer.start,
                timer.first,
                [len(s.token_ids) for s in streams],
                outcome == "ok",
                prep.cache_status if self.cache else "off",
            )
            await events.aclose()
            if workers and not all(s.finished for s in streams):
                log.info("aborting request", extra={"request_id": prep.request_id})
                await self.backend.abort(prep)

    async def _source(self, prep: PreparedRequest) -> tuple[AsyncIterator[TokenEvent], bool]:
        """The request's events, and whether the workers make them.

        The exact tier is asked first (one Redis read, at most 30 ms): its hit costs the
        workers nothing. Past it (and the head start, if any) the workers start and the
        semantic lookup runs beside them, deciding before anything is streamed: a hit
        replaces the workers' answer (their work is aborted); a miss costs only the time
        the lookup outlasts the workers' first token (docs/semantic-cache.md)."""
        query = self.cache.query(prep) if self.cache is not None else None
        if query is None:
            if self.cache is not None:
                GATEWAY_CACHE.labels("skipped").inc()
            return self.backend.generate(prep), True
        cached = await self.cache.lookup(prep, query, exact_only=True)
        if cached is None:  # EPD_CACHE_HEAD_START_MS: a semantic hit that comes first
            cached = await self.cache.head_start(prep, query)
        if cached is not None:
            return replay(cached, len(prep.prompt_token_ids)), False
        events = self.backend.generate(prep)
        if not query.text:  # nothing to compare by meaning
            GATEWAY_CACHE.labels("miss").inc()
            return events, True
        first = asyncio.ensure_future(anext(events))
        try:
            cached = await self.cache.lookup(prep, query, exact_only=False)
        except BaseException:
            await _discard(first, events)
            raise
        if cached is None:
            return _resume(first, events), True
        await _discard(first, events)
        task = asyncio.create_task(self.backend.abort(prep))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        return replay(cached, len(prep.prompt_token_ids)), False


async def _resume(first: asyncio.Future, events: AsyncIterator[TokenEvent]):
    """``events`` whose first item is already being fetched by ``first``."""
    try:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for event in events:
            yield event
    finally:
        await events.aclose()


async def _discard(first: asyncio.Future, events: AsyncIterator[TokenEvent]) -> None:
    first.cancel()
    with contextlib.suppress(BaseException):
        await first
    with contextlib.suppress(Exception):
        await events.aclose()


def _content_size(messages) -> int:
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    image = part.get("image")
                    total += (
                        len(image) if isinstance(image, bytes) else len(str(part.get("text", "")))
                    )
    return total
