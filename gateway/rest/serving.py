"""One completion request end to end over the GatewayCore: run its prompts, then answer
as one JSON body or as server-sent events. Chat and text completions differ only in how
a choice is rendered (``Renderer``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.responses import JSONResponse, Response

from gateway.core import GatewayCore
from gateway.errors import classify
from gateway.prepare import PreparedRequest
from gateway.rest.responses import (
    SSEResponse,
    dumps,
    error_response,
    now,
    response_id,
    sse,
    usage,
)
from gateway.stream import Delta, OutputStream

Item = tuple[int, Delta, list[OutputStream]]  # (prompt number, delta, that prompt's choices)


class Renderer(Protocol):
    object: str  # "chat.completion" / "text_completion"
    chunk_object: str
    id_prefix: str

    def choice(self, prompt: int, stream: OutputStream) -> dict: ...
    def chunk_choice(
        self, prompt: int, delta: Delta, stream: OutputStream, first: bool
    ) -> dict: ...


def cache_headers(preps: list[PreparedRequest]) -> dict:
    """x-epd-cache: a hit when every prompt of the request came from the cache."""
    statuses = {p.cache_status for p in preps}
    status = statuses.pop() if len(statuses) == 1 else "miss"
    headers = {"x-epd-cache": status}
    if status == "hit-semantic":
        headers["x-epd-cache-similarity"] = f"{min(p.cache_similarity for p in preps):.4f}"
    return headers


def finish_reason(stream: OutputStream) -> str | None:
    reason = stream.state.finish_reason
    return None if reason is None else ("length" if reason == "length" else "stop")


class CompletionRun:
    """The runs of one request's prompts on the core (a text completion may carry several)."""

    def __init__(self, core: GatewayCore, preps: list[PreparedRequest], renderer: Renderer):
        self.core, self.preps, self.renderer = core, preps, renderer
        self.header = {
            "id": response_id(renderer.id_prefix),
            "created": now(),
            "model": core.info.model_id,
            "system_fingerprint": f"fp_{core.info.fingerprint}",
        }
        self.streams: list[list[OutputStream]] = [[] for _ in preps]

    async def items(self) -> AsyncIterator[Item]:
        if len(self.preps) == 1:
            async for delta, streams in self.core.run(self.preps[0]):
                self.streams[0] = streams
                yield 0, delta, streams
            return
        async for item in _merged([self.core.run(p) for p in self.preps]):
            self.streams[item[0]] = item[2]
            yield item

    async def respond(self, stream: bool, include_usage: bool, headers: dict) -> Response:
        items = self.items()
        try:  # wait for the first delta: early failures get a real status code
            first = await anext(items)
        except StopAsyncIteration:
            first = None
        except Exception as e:
            await items.aclose()
            return error_response(classify(e, self.preps[0].request_id), headers)
        headers = {**headers, **cache_headers(self.preps), **self.preps[0].route_headers}
        if stream:
            events = self._events(first, items, include_usage)
            return SSEResponse(events, self.preps[0].request_id, headers)
        try:
            async for _ in items:
                pass
        except Exception as e:
            return error_response(classify(e, self.preps[0].request_id), headers)
        return JSONResponse(self.body(), headers=headers)

    def body(self) -> dict:
        r = self.renderer
        choices = [r.choice(k, s) for k, group in enumerate(self.streams) for s in group]
        return {
            **self.header,
            "object": r.object,
            "choices": choices,
            "usage": usage(self.preps, self.streams),
        }

    async def _events(self, first: Item | None, rest: AsyncIterator[Item], include_usage: bool):
        r, started = self.renderer, set()
        # Every chunk is the same object but for its one choice: the rest is encoded once
        # (the bytes are those of dumping the whole chunk).
        fixed = dumps({**self.header, "object": r.chunk_object})[:-1]
        head = f'data: {fixed},"choices":['.encode()
        tail = ("]" + (',"usage":null' if include_usage else "") + "}\n\n").encode()
        try:
            item = first
            while item is not None:
                k, delta, streams = item
                key = (k, delta.index)
                choice = r.chunk_choice(k, delta, streams[delta.index], key not in started)
                started.add(key)
                yield head + dumps(choice).encode() + tail
                item = await anext(rest, None)
            if include_usage:
                yield sse(
                    {
                        **self.header,
                        "object": r.chunk_object,
                        "choices": [],
                        "usage": usage(self.preps, self.streams),
                    }
                )
        finally:
            await rest.aclose()


async def _merged(runs: list[AsyncIterator]) -> AsyncIterator[Item]:
    """Items of several runs as they come; the first failure ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, run: AsyncIterator) -> None:
        try:
            async for delta, streams in run:
                queue.put_nowait((k, delta, streams))
            queue.put_nowait(done)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            await run.aclose()

    tasks = [asyncio.create_task(pump(k, run)) for k, run in enumerate(runs)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
