"""The service skeleton for the roles that run the engine (prefill and decode).

On top of services/service.py: the engine thread, abort handling, heartbeats with the
engine's load, and the engine's side of the drain: a request counts as in flight while
it has a route here (or a hand-off under way), and whatever is still in flight at the
end of the grace is handed back to its gateway with a retryable UNAVAILABLE error. A
role adds its own subscriptions (``_register``) and step-output handling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.errors import BusError
from services.bus.handlers import Incoming
from services.bus.heartbeat import Load
from services.config import EngineConfig, ServiceConfig
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.recent import RecentIds
from services.service import Service
from services.wire import FINISH_TO_PROTO, error

log = logging.getLogger(__name__)


class EngineService(Service):
    """Base of PrefillService and DecodeService."""

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        super().__init__(config)
        self.engine_config = engine_config
        self.engine: AsyncEngine | None = None
        # request id -> the message that brought it (where its outputs go)
        self.routes: dict = {}
        # request id -> (its request, the task handing it to another instance)
        self.handing_off: dict[str, tuple[Any, asyncio.Task]] = {}
        # Aborts may overtake the work they cancel; remember them for a while.
        self.aborted = RecentIds(ttl_s=120.0)
        self._tasks: set[asyncio.Task] = set()

    # -- the skeleton's hooks -----------------------------------------------------------
    async def load(self) -> None:
        llm = await asyncio.to_thread(LLMEngine, self.engine_config)
        self.model_fingerprint = llm.loaded.fingerprint
        self.engine = AsyncEngine(llm, on_outputs=self._step_outputs)
        self.engine.start()

    async def register(self) -> None:
        await self._register(self.engine.engine)
        await self.bus.subscribe(subjects.ABORT, self._on_abort, max_concurrency=16)

    def report_load(self) -> Load:
        load = self.engine.load()
        return Load(
            load["running"],
            load["waiting"],
            load["free_blocks"],
            load["total_blocks"],
            steps=load["steps"],
        )

    def busy(self) -> bool:
        return bool(self.routes or self._tasks)

    async def hand_back(self) -> None:
        await self._fail_in_flight(f"the {self.role} instance is shutting down")

    async def release(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()

    # -- the role's hooks ---------------------------------------------------------------
    async def _register(self, llm: LLMEngine) -> None:
        """Subscribe the role's own subjects."""
        raise NotImplementedError

    def _on_outputs(self, outputs) -> None:
        """One engine step's outputs, on the event loop."""
        raise NotImplementedError

    # -- inside -------------------------------------------------------------------------
    def _step_outputs(self, outputs) -> None:
        self._on_outputs(outputs)
        self.progressed()  # requests may have finished: a drain re-checks

    @staticmethod
    def answering(request_type, reply_type, work):
        """A handler for one request/reply subject: decode ``request_type``, run
        ``await work(req)`` (an Error or None) and answer ``reply_type`` with it."""

        async def handle(msg: Incoming) -> None:
            req = msg.decode(request_type)
            reply = reply_type(request_id=req.request_id)
            problem = await work(req)
            if problem is not None:
                reply.error.CopyFrom(problem)
            await msg.respond(reply)

        return handle

    def _spawn(self, coro: Coroutine[Any, Any, None], owner=None) -> None:
        """Run ``coro`` in the background; ``owner`` (a request with a ``gateway_id``)
        is owed an error if the task is still running when the grace ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        if owner is not None:
            self.handing_off[owner.request_id] = (owner, task)
        task.add_done_callback(lambda t: self._task_done(t, owner))

    def _task_done(self, task: asyncio.Task, owner) -> None:
        self._tasks.discard(task)
        if owner is not None and self.handing_off.get(owner.request_id, (None, None))[1] is task:
            del self.handing_off[owner.request_id]
        self.progressed()

    async def _on_abort(self, msg: Incoming) -> None:
        rid = msg.decode(bus_pb2.Abort).request_id
        self.aborted.add(rid)
        if self.routes.pop(rid, None) is not None:
            await self.engine.abort(rid)
            self.progressed()

    async def _fail_in_flight(self, reason: str) -> None:
        """Tell each gateway its requests here will not finish (no silent loss)."""
        owed = dict(self.routes)
        for rid, (req, task) in self.handing_off.items():
            owed[rid] = req
            task.cancel()  # its own error report would come second (or not at all)
        batches: dict[str, bus_pb2.TokenBatch] = {}
        for rid, req in owed.items():
            upd = bus_pb2.TokenUpdate(request_id=rid, finish_reason=FINISH_TO_PROTO["error"])
            upd.error.CopyFrom(error(bus_pb2.ERROR_CODE_UNAVAILABLE, reason))
            batches.setdefault(
                req.gateway_id, bus_pb2.TokenBatch(instance_id=self.instance_id)
            ).updates.append(upd)
        self.routes.clear()
        self.handing_off.clear()
        for gateway_id, batch in batches.items():
            try:
                await self.bus.publish(subjects.out(gateway_id), batch)
            except BusError as e:
                log.warning("could not tell gateway %s about shutdown: %s", gateway_id, e)
