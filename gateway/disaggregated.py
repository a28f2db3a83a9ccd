"""Requests across the fleet: encode missing images, prefill on one instance, decode on
another, tokens back on ``epd.out.<gateway-id>``.

The decode instance is chosen first (least loaded by heartbeats, round robin on ties)
and named in the prefill request, so prefill can ship the KV straight to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from gateway.encode import ImageEncoder
from gateway.events import BackendError, TokenEvent
from gateway.prepare import PreparedRequest
from gateway.reorder import UpdateOrderer
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.errors import BusError, NoResponders
from services.bus.handlers import Incoming
from services.bus.heartbeat import InstanceRegistry
from services.config import EngineConfig, ServiceConfig
from services.engine.parallel_sampling import child_request_id as choice_request_id
from services.models.info import ModelInfo
from services.runtime import connect_bus
from services.sampling_params import choice_seed
from services.wire import STATUS, params_to_proto, spans_to_proto

log = logging.getLogger(__name__)

# How often a waiting request checks that its workers are still alive.
_LIVENESS_TICK_S = 0.5


class DisaggregatedBackend:
    def __init__(self, engine_config: EngineConfig, config: ServiceConfig, gateway_id: str):
        self.engine_config = engine_config
        self.config = config
        self.gateway_id = gateway_id
        self.bus = self.registry = self.encoder = None
        self.streams: dict[str, asyncio.Queue] = {}  # (choice) request id -> its updates
        self.fan_outs: dict[str, list[asyncio.Task]] = {}  # n > 1: one task per choice

    async def start(self) -> None:
        self.info = ModelInfo.load(self.engine_config)
        self.eos = list(self.info.eos_token_ids())
        self.bus = await connect_bus(self.config, self.gateway_id)
        self.registry = InstanceRegistry(self.bus, [subjects.ROLE_ENCODE, subjects.ROLE_PREFILL,
                                                    subjects.ROLE_DECODE],
                                         expiry_s=self.config.instance_ttl_s)  # fmt: skip
        await self.registry.start()
        self.encoder = ImageEncoder(self.bus, self.info.fingerprint, self.config.bus_timeout_s,
                                    lambda: self._pick(subjects.ROLE_ENCODE))  # fmt: skip
        await self.bus.subscribe(subjects.out(self.gateway_id), self._on_tokens)

    async def stop(self) -> None:
        if self.registry is not None:
            await self.registry.stop()
        if self.bus is not None:
            await self.bus.close()

    def ready(self) -> bool:
        """Serving needs a prefill and a decode instance (and an encoder for a VLM)."""
        if self.bus is None or not self.bus.is_connected:
            return False
        roles = [subjects.ROLE_PREFILL, subjects.ROLE_DECODE]
        roles += [subjects.ROLE_ENCODE] if self.info.vision else []
        fp = self.info.fingerprint
        return all(any(i.model == fp for i in self.registry.live(role)) for role in roles)

    async def _on_tokens(self, msg: Incoming) -> None:
        for upd in msg.decode(bus_pb2.TokenBatch).updates:
            q = self.streams.get(upd.request_id)
            if q is not None:
                q.put_nowait(upd)

    def _pick(self, role: str) -> str:
        chosen = self.registry.pick_least_loaded(role, model=self.info.fingerprint)
        if chosen is None:
            raise BackendError("UNAVAILABLE", f"no live {role} instance")
        return chosen

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]:
        prefill_id = self._pick(subjects.ROLE_PREFILL)
        pushed = await self.encoder.encode(prep, prefill_id)
        if prep.params.n == 1:
            decode_id = self._pick(subjects.ROLE_DECODE)
            async for event in self._choice(prep, prep.request_id, prep.params, prefill_id,
                                            decode_id, pushed):  # fmt: skip
                yield event
            return
        async for event in self._fan_out(prep, prefill_id, pushed):
            yield event

    async def _fan_out(self, prep, prefill_id: str, pushed: dict) -> AsyncIterator[TokenEvent]:
        """n > 1 over the fleet: one request per choice (seeds as the engine derives
        them), all on one prefill instance; the siblings start once choice 0 has its
        first token, so its prompt blocks are in that instance's prefix cache."""
        merged: asyncio.Queue = asyncio.Queue()
        first_token = asyncio.Event()

        async def pump(i: int) -> None:
            try:
                seed = None if prep.params.seed is None else choice_seed(prep.params.seed, i)
                params = dataclasses.replace(prep.params, n=1, seed=seed)
                if i:
                    await first_token.wait()
                decode_id = self._pick(subjects.ROLE_DECODE)
                async for event in self._choice(prep, choice_request_id(prep.request_id, i),
                                                params, prefill_id, decode_id, pushed):  # fmt: skip
                    event.index = i
                    merged.put_nowait(event)
                    first_token.set()
            except Exception as e:  # the consumer raises it
                merged.put_nowait(e)
                first_token.set()

        tasks = [asyncio.create_task(pump(i)) for i in range(prep.params.n)]
        self.fan_outs[prep.request_id] = tasks
        try:
            while True:
                item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.fan_outs.pop(prep.request_id, None)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice(self, prep, rid: str, params, prefill_id: str, decode_id: str,
                      pushed: dict) -> AsyncIterator[TokenEvent]:  # fmt: skip
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = q
        try:
            await self._prefill(prep, rid, params, prefill_id, decode_id, pushed)
            async for event in self._events(prep, q, prefill_id, decode_id):
                yield event
        finally:
            self.streams.pop(rid, None)

    async def _prefill(self, prep, rid: str, params, prefill_id: str, decode_id: str,
                       pushed: dict) -> None:  # fmt: skip
        spans = spans_to_proto(prep.spans, self.encoder.keys_for(prep))
        for span in spans:
            if span.image_hash in pushed:
                span.embedding_ref.CopyFrom(pushed[span.image_hash])
        req = bus_pb2.PrefillRequest(
            request_id=rid, gateway_id=self.gateway_id, decode_instance_id=decode_id,
            prompt_token_ids=prep.prompt_token_ids, image_spans=spans,
            sampling=params_to_proto(params), deadline_unix_ms=int(prep.deadline * 1000),
            eos_token_ids=self.eos, max_model_len=self.info.max_model_len,
        )  # fmt: skip
        try:
            reply = await self.bus.request(subjects.prefill(prefill_id), req, bus_pb2.PrefillReply,
                                           self.config.bus_timeout_s)  # fmt: skip
        except NoResponders as e:
            raise BackendError("UNAVAILABLE", f"prefill instance {prefill_id} is gone") from e
        except BusError as e:
            raise BackendError("UNAVAILABLE", f"prefill instance {prefill_id} failed: {e}") from e
        if reply.HasField("error"):
            raise BackendError(STATUS.get(reply.error.code, "INTERNAL"), reply.error.message)

    async def _events(self, prep, q, prefill_id, decode_id) -> AsyncIterator[TokenEvent]:
        order = UpdateOrderer()
        last = time.monotonic()
        while True:
            try:
                upd = await asyncio.wait_for(q.get(), _LIVENESS_TICK_S)
            except TimeoutError:
                self._check_alive(prep, order, prefill_id, decode_id, last)
                continue
            last = time.monotonic()
            for ready in order.push(upd):
                if ready.HasField("error"):
                    raise BackendError(
                        STATUS.get(ready.error.code, "INTERNAL"), ready.error.message
                    )
                event = order.event(ready)
                yield event
                if event.finish_reason is not None:
                    return

    def _check_alive(self, prep, order, prefill_id, decode_id, last: float) -> None:
        now = time.monotonic()
        if time.time() > prep.deadline:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline")
        worker, role = (decode_id, "decode") if order.started else (prefill_id, "prefill")
        live = {i.instance_id for i in self.registry.live(role, include_draining=True)}
        if worker not in live:
            raise BackendError("UNAVAILABLE", f"{role} instance {worker} went away mid-request")
        if now - last > self.config.stall_timeout_s:
            raise BackendError(
                "UNAVAILABLE",
                f"no tokens for {self.config.stall_timeout_s:.0f}s from {role} {worker}",
            )

    async def abort(self, prep: PreparedRequest, index: int | None = None) -> None:
        """Abort the request (every choice) or one choice on every service."""
        ids = [prep.request_id]
        if prep.params.n > 1:
            indices = range(prep.params.n) if index is None else [index]
            ids = [choice_request_id(prep.request_id, i) for i in indices]
            tasks = self.fan_outs.get(prep.request_id, [])
            if index is not None and index < len(tasks):
                tasks[index].cancel()
        for rid in ids:
            try:
                await self.bus.publish(
                    subjects.ABORT, bus_pb2.Abort(request_id=rid, reason="client")
                )
            except BusError as e:
                log.warning("abort of %s not sent: %s", rid, e)
