"""``serve all``: the whole engine in the gateway's process (the comparison baseline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from gateway.events import BackendError, TokenEvent, events_from_output
from gateway.prepare import PreparedRequest
from services import metrics
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.parallel_sampling import child_request_id


class AggregatedBackend:
    """Serves prepared requests from an in-process ``AsyncEngine`` (n > 1 included: the
    engine runs the choices over one prompt)."""

    def __init__(self, engine: AsyncEngine, instance_id: str = "all"):
        self.engine = engine
        self.instance_id = instance_id

    def refresh_metrics(self) -> None:
        """The engine's load gauges (a fleet instance sets them on every heartbeat; this
        process sends none, so they are read when /metrics is scraped)."""
        load, labels = self.engine.load(), ("all", self.instance_id)
        metrics.RUNNING.labels(*labels).set(load["running"])
        metrics.WAITING.labels(*labels).set(load["waiting"])
        metrics.KV_BLOCKS_FREE.labels(*labels).set(load["free_blocks"])
        metrics.KV_BLOCKS_USED.labels(*labels).set(load["total_blocks"] - load["free_blocks"])

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.shutdown()

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]:
        prompt = {"prompt_token_ids": prep.prompt_token_ids, "images": prep.images}
        n = prep.params.logprobs or 0
        outputs = self.engine.generate(prep.request_id, prompt, prep.params)
        try:
            while True:
                try:  # the deadline holds between outputs too (time.time: it is unix time)
                    async with asyncio.timeout(max(0.0, prep.deadline - time.time())):
                        out = await anext(outputs)
                except StopAsyncIteration:
                    return
                for event in events_from_output(out, n):
                    yield event
        except TimeoutError as e:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline") from e
        except EngineDeadError as e:
            raise BackendError("UNAVAILABLE", str(e)) from e
        finally:
            await outputs.aclose()

    async def abort(self, prep: PreparedRequest, index: int | None = None) -> None:
        rid = prep.request_id
        if index is not None and prep.params.n > 1:
            rid = child_request_id(rid, index)
        await self.engine.abort(rid)

    def ready(self) -> bool:
        return self.engine.alive
