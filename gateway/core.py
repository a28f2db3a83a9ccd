"""The protocol-independent gateway: prepare, (cache,) run on a backend, stream deltas."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

from gateway.events import BackendError, TokenEvent
from gateway.prepare import PreparedRequest, RequestPreparer
from gateway.stream import Delta, OutputStream

log = logging.getLogger(__name__)


class ServingBackend(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]: ...
    async def abort(self, request_id: str) -> None: ...
    def ready(self) -> bool: ...


class GatewayCore:
    """Shared by the gRPC server and the OpenAI app."""

    def __init__(self, preparer: RequestPreparer, backend: ServingBackend):
        self.preparer = preparer
        self.backend = backend
        self.tokenizer = preparer.tokenizer
        self.info = preparer.info

    async def run(self, prep: PreparedRequest) -> AsyncIterator[tuple[Delta, OutputStream]]:
        """Yield (delta, stream) until the request finishes; abort it on the workers if the
        consumer stops early or a stop string ends it here."""
        stream = OutputStream(prep, self.tokenizer)
        events = self.backend.generate(prep)
        try:
            async for event in events:
                delta = stream.add(event)
                if delta.token_ids or delta.text or delta.finish_reason:
                    yield delta, stream
                if stream.finished:
                    return
            # Accepted work is never lost silently: the client learns it did not finish.
            raise BackendError("UNAVAILABLE", "the workers stopped before the request finished")
        finally:
            await events.aclose()
            if not stream.finished or stream.stopped:
                log.info("aborting request", extra={"request_id": prep.request_id})
                await self.backend.abort(prep.request_id)
