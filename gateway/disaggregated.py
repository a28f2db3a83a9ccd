"""Requests across the fleet: encode missing images, prefill on one instance, decode on
another, tokens back on ``epd.out.<gateway-id>``.

The router (gateway/router.py) picks the decode instance first, then the prefill
instance, so prefill can ship the KV straight to decode. When a worker dies, stalls or
refuses, the choice goes on elsewhere (``_choice``): before its first token that is a
retry; after it a migration (at most ``migration_limit``): prefill recomputes the prompt
plus every token already sent (its prefix cache makes that cheap) and the stream
continues at the offset the client reached, with no token repeated or lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from gateway.attempt import RETRYABLE, Route, WorkerLost, stream_updates, while_alive
from gateway.config import GatewayConfig
from gateway.encode import EmbeddingsMissing, Encodings, ImageEncoder
from gateway.events import BackendError, TokenEvent
from gateway.fleet_link import FleetLink
from gateway.policies import RouteHint, block_hashes
from gateway.prepare import PreparedRequest
from gateway.reorder import UpdateOrderer
from gateway.router import Router
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.errors import BusError
from services.config import EngineConfig, ServiceConfig
from services.engine.parallel_sampling import child_request_id as choice_request_id
from services.metrics import MIGRATIONS
from services.models.info import ModelInfo
from services.sampling_params import choice_seed
from services.structured.outputs import StructuredOutputs
from services.wire import STATUS, params_to_proto, spans_to_proto

log = logging.getLogger(__name__)

# Prompt blocks the prefix-aware router hashes (the engines' default block size).
_ROUTE_BLOCK_TOKENS = 16


class DisaggregatedBackend:
    """One model's requests over the fleet. ``link``: the gateway's connection shared
    with its other models' backends (started and stopped by the gateway); without one
    the backend opens its own."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServiceConfig,
        gateway_id: str,
        api: GatewayConfig | None = None,
        link: FleetLink | None = None,
    ):
        self.engine_config = engine_config
        self.config = config
        self.api = api or GatewayConfig()
        self.gateway_id = gateway_id
        self.link, self._own_link = link, link is None
        self.bus = self.registry = self.encoder = self.router = None
        self.routes: dict[str, Route] = {}  # attempt's request id -> its route
        self.current: dict[str, str] = {}  # choice's request id -> its attempt's id
        self.fan_outs: dict[str, list[asyncio.Task]] = {}  # n > 1: one task per choice

    async def start(self) -> None:
        self.info = ModelInfo.load(self.engine_config)
        self.eos = list(self.info.eos_token_ids())
        if self._own_link:
            self.link = FleetLink(self.config, self.gateway_id)
            await self.link.start()
        self.bus, self.registry, self.routes = self.link.bus, self.link.registry, self.link.routes
        self.router = Router(self.registry, self.info.fingerprint, self.api)
        self.encoder = ImageEncoder(
            self.bus,
            self.info.fingerprint,
            self.config.bus_timeout_s,
            self.config.stall_timeout_s,
            self.router,
            self.link,
        )

    async def stop(self) -> None:
        if self._own_link and self.link is not None:
            await self.link.stop()

    async def check_constraint(self, constraint: StructuredOutputs) -> None:
        """ValueError when ``constraint`` does not compile (its syntax: the workers
        compile it for the model's tokenizer); in a thread, off the event loop."""
        await asyncio.to_thread(constraint.check)

    def ready(self) -> bool:
        """Serving needs a prefill and a decode instance (and an encoder for a VLM)."""
        if not self.serving():
            return False
        return not self.info.vision or bool(self.router.live(subjects.ROLE_ENCODE))

    def serving(self) -> bool:
        """This model has live prefill and decode instances (text requests can run)."""
        if self.bus is None or not self.bus.is_connected or self.router is None:
            return False
        return all(self.router.live(role) for role in (subjects.ROLE_PREFILL, subjects.ROLE_DECODE))

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]:
        images = Encodings(self.encoder, prep)
        try:
            if prep.params.n == 1:
                async for event in self._choice(prep, prep.request_id, prep.params, images):
                    yield event
                return
            async for event in self._fan_out(prep, images):
                yield event
        finally:
            images.cancel()

    async def _fan_out(self, prep, images: Encodings) -> AsyncIterator[TokenEvent]:
        """n > 1 over the fleet: one request per choice (seeds as the engine derives
        them); the siblings start once choice 0 has its first token, so the router
        sends them where its prompt blocks are cached."""
        merged: asyncio.Queue = asyncio.Queue()
        first_token = asyncio.Event()

        async def pump(i: int) -> None:
            try:
                seed = None if prep.params.seed is None else choice_seed(prep.params.seed, i)
                params = dataclasses.replace(prep.params, n=1, seed=seed)
                if i:
                    await first_token.wait()
                async for event in self._choice(
                    prep, choice_request_id(prep.request_id, i), params, images
                ):
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

    async def _choice(self, prep, rid: str, params, images: Encodings) -> AsyncIterator[TokenEvent]:
        """One choice across attempts until it finishes, fails for its own reasons, runs
        out of instances or of ``migration_limit``."""
        sent: list[int] = []
        failed: dict[str, set[str]] = {subjects.ROLE_PREFILL: set(), subjects.ROLE_DECODE: set()}
        order, attempt, migrations = UpdateOrderer(), 0, 0
        hint = RouteHint(prep.session_key, block_hashes(prep.prompt_token_ids, _ROUTE_BLOCK_TOKENS))
        try:
            while True:
                arid = rid if attempt == 0 else f"{rid}-m{attempt}"
                self.current[rid] = arid
                order.begin(len(sent))
                try:
                    attempt_events = self._attempt(
                        prep, arid, params, images, sent, failed, order, hint
                    )
                    async for event in attempt_events:
                        sent.extend(event.token_ids)
                        yield event
                    return
                except WorkerLost as lost:
                    failed[lost.role].add(lost.instance_id)
                    migrations += bool(sent)
                    MIGRATIONS.labels(lost.role, "migration" if sent else "retry").inc()
                    if migrations > self.api.migration_limit:
                        raise BackendError(
                            "UNAVAILABLE",
                            f"{lost}; gave up after {self.api.migration_limit} migrations",
                        ) from lost
                    log.warning("request %s moves on after %s tokens: %s", rid, len(sent), lost)
                attempt += 1
        finally:
            self.current.pop(rid, None)

    async def _attempt(
        self, prep, arid, params, images, sent, failed, order, hint
    ) -> AsyncIterator[TokenEvent]:
        # Decode imports its KV: only the session key matters there, not prefix locality.
        decode = self.router.pick(
            subjects.ROLE_DECODE,
            exclude=failed[subjects.ROLE_DECODE],
            hint=RouteHint(hint.session_key),
        )
        prefill = None
        local = self._prefill_locally(prep, sent, decode.instance_id, hint)
        if not local:
            try:
                prefill = self.router.pick(
                    subjects.ROLE_PREFILL, hint=hint, exclude=failed[subjects.ROLE_PREFILL]
                )
            except BaseException:
                decode.release()
                raise
        pid = decode.instance_id if local else prefill.instance_id
        route = Route(pid, decode.instance_id, len(sent), local=local)
        self.routes[arid] = route
        finished = False
        try:
            try:
                await self._prefill(prep, arid, params, await images.for_prefill(pid), sent, route)
            except EmbeddingsMissing:  # e.g. evicted from Redis: encoded again, pushed there
                pushed = await images.for_prefill(pid, push=True)
                await self._prefill(prep, arid, params, pushed, sent, route, last_try=True)
            async for event in stream_updates(
                route, order, prep.deadline, self.config.stall_timeout_s, self.link
            ):
                if prefill is not None and not prefill.released:
                    self.router.succeeded(subjects.ROLE_PREFILL, prefill.instance_id)
                    prefill.release()
                finished = event.finish_reason is not None
                yield event
            self.router.succeeded(subjects.ROLE_DECODE, decode.instance_id)
        except WorkerLost as lost:
            (prefill if lost.role == subjects.ROLE_PREFILL and prefill else decode).failed()
            raise
        finally:
            self.routes.pop(arid, None)
            if prefill is not None:
                prefill.release()
            decode.release()
            if not finished:  # failed, moved on or abandoned: free its workers
                self._spawn_abort(arid, "unfinished")

    def _prefill_locally(self, prep, sent: list[int], decode_id: str, hint: RouteHint) -> bool:
        """Conditional disaggregation (Dynamo's): a text prompt whose part not cached on
        the decode instance is at most ``max_local_prefill_tokens`` prefills there: a
        short prefill costs less than a KV transfer and a second hop."""
        limit = self.api.max_local_prefill_tokens
        if not limit or prep.spans:
            return False
        cached = _ROUTE_BLOCK_TOKENS * self.router.prefix_match(
            subjects.ROLE_DECODE, decode_id, hint.block_hashes
        )
        if len(prep.prompt_token_ids) + len(sent) - cached > limit:
            return False
        self.router.note_prefix(subjects.ROLE_DECODE, decode_id, hint.block_hashes)
        return True

    async def _prefill(
        self,
        prep,
        arid: str,
        params,
        pushed: dict,
        sent: list[int],
        route: Route,
        last_try: bool = False,
    ) -> None:
        """Admission on the prefill instance (the decode instance itself when local)."""
        pid = route.prefill_id
        role = subjects.ROLE_DECODE if route.local else subjects.ROLE_PREFILL
        spans = spans_to_proto(prep.spans, self.encoder.keys_for(prep))
        for span in spans:
            if span.image_hash in pushed:
                span.embedding_ref.CopyFrom(pushed[span.image_hash])
        req = bus_pb2.PrefillRequest(
            request_id=arid,
            gateway_id=self.gateway_id,
            decode_instance_id=route.decode_id,
            prompt_token_ids=prep.prompt_token_ids,
            image_spans=spans,
            sampling=params_to_proto(params),
            deadline_unix_ms=int(prep.deadline * 1000),
            eos_token_ids=self.eos,
            max_model_len=self.info.max_model_len,
            output_token_ids=sent,
        )
        ask = self.bus.request(
            subjects.prefill(self.info.fingerprint, pid),
            req,
            bus_pb2.PrefillReply,
            self.config.bus_timeout_s,
        )
        try:
            reply = await while_alive(
                ask,
                lambda: self.link.alive(role, pid),
                lambda: WorkerLost(role, pid, "went away during admission"),
                lambda: self.link.answers_ping(role, pid),
            )
        except BusError as e:
            raise WorkerLost(role, pid, f"dispatch failed: {e}") from e
        if reply.HasField("error"):
            code = STATUS.get(reply.error.code, "INTERNAL")
            if code == "NOT_FOUND" and not last_try:
                raise EmbeddingsMissing(reply.error.message)
            if code in RETRYABLE:
                raise WorkerLost(role, pid, reply.error.message)
            raise BackendError(code, reply.error.message)

    def _spawn_abort(self, rid: str, reason: str) -> None:
        task = asyncio.ensure_future(self._publish_abort(rid, reason))
        task.add_done_callback(lambda t: t.exception())

    async def _publish_abort(self, rid: str, reason: str) -> None:
        try:
            await self.bus.publish(subjects.ABORT, bus_pb2.Abort(request_id=rid, reason=reason))
        except BusError as e:
            log.warning("abort of %s not sent: %s", rid, e)

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
            await self._publish_abort(self.current.get(rid, rid), "client")
