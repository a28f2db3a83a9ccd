"""The common shape of the services that run the engine (prefill and decode).

main -> connect -> register handlers -> serve -> ordered shutdown (STYLE.md 10): the
engine thread, one bus connection, abort handling and heartbeats with the engine's load
live here; a role adds its own subscriptions and its step-output handling.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.handlers import Incoming
from services.bus.heartbeat import HeartbeatPublisher, Load
from services.config import EngineConfig, ServiceConfig
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.recent import RecentIds
from services.runtime import connect_bus

log = logging.getLogger(__name__)


class EngineService:
    role = ""

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        self.engine_config = engine_config
        self.config = config
        self.instance_id = config.instance_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.engine: AsyncEngine | None = None
        self.bus = self.heartbeat = None
        # request id -> the message that brought it (where its outputs go)
        self.routes: dict = {}
        # Aborts may overtake the work they cancel; remember them for a while.
        self.aborted = RecentIds(ttl_s=120.0)
        self._tasks: set[asyncio.Task] = set()
        self._stopped = False

    async def start(self) -> None:
        llm = await asyncio.to_thread(LLMEngine, self.engine_config)
        self.engine = AsyncEngine(llm, on_outputs=self._on_outputs)
        self.engine.start()
        self.bus = await connect_bus(self.config, self.instance_id)
        await self._register(llm)
        await self.bus.subscribe(subjects.ABORT, self._on_abort, max_concurrency=16)
        self.heartbeat = HeartbeatPublisher(self.bus, self.role, self.instance_id, self._load,
                                            interval_s=self.config.heartbeat_s,
                                            model=llm.loaded.fingerprint)  # fmt: skip
        await self.heartbeat.start()
        log.info("%s %s ready", self.role, self.instance_id)

    async def _register(self, llm: LLMEngine) -> None:
        """Subscribe the role's own subjects."""
        raise NotImplementedError

    def _on_outputs(self, outputs) -> None:
        """One engine step's outputs, on the event loop."""
        raise NotImplementedError

    def _load(self) -> Load:
        load = self.engine.load()
        return Load(load["running"], load["waiting"], load["free_blocks"], load["total_blocks"])

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_abort(self, msg: Incoming) -> None:
        rid = msg.decode(bus_pb2.Abort).request_id
        self.aborted.add(rid)
        if self.routes.pop(rid, None) is not None:
            await self.engine.abort(rid)

    async def _before_drain(self) -> None:
        """Hook: last words to the gateways before the bus drains."""

    async def _close_extra(self) -> None:
        """Hook: close what the role opened besides the bus and the engine."""

    async def stop(self) -> None:
        """Heartbeats off (routers stop sending), finish pending sends within the grace
        period, drain the bus, stop the engine; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.bus is not None:
            await self._before_drain()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.shutdown_grace_s)
        if self.bus is not None:
            await self.bus.close()
        if self.engine is not None:
            await self.engine.shutdown()
        await self._close_extra()
