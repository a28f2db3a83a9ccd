"""``serve all``: the whole engine in the gateway's process (the comparison baseline)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.events import BackendError, TokenEvent, event_from_output
from gateway.prepare import PreparedRequest
from services.engine.async_engine import AsyncEngine, EngineDeadError


class AggregatedBackend:
    """Serves prepared requests from an in-process ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.shutdown()

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]:
        prompt = {"prompt_token_ids": prep.prompt_token_ids, "images": prep.images}
        sent = 0
        n = prep.params.logprobs or 0
        try:
            async for out in self.engine.generate(prep.request_id, prompt, prep.params):
                event = event_from_output(out, sent, n)
                sent += len(event.token_ids)
                yield event
        except EngineDeadError as e:
            raise BackendError("UNAVAILABLE", str(e)) from e

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def ready(self) -> bool:
        return self.engine.alive
