"""The one service skeleton every role stands on (DESIGN.md "Layout", STYLE.md 10).

settings (``__init__``) -> load -> connect -> register handlers -> heartbeat -> serve
-> drain -> close. A role overrides only the hooks that are its own: ``load``,
``register``, ``report_load``, ``busy``, ``stop_intake``, ``hand_back``, ``release``.

The drain (``stop``, once per process; a second call waits for the same one):

1. announce "draining" in a heartbeat at once, and keep beating as draining: routers
   send no new work, but know the instance is alive and finishing;
2. stop intake: queue-group subjects are unsubscribed (another replica takes the work;
   messages already delivered here are still served), per-instance subjects answer
   new work with a retryable UNAVAILABLE "draining" (see ``serve_work``);
3. wait until the work in flight is done, at most ``ServiceConfig.shutdown_grace_s``;
4. ``hand_back``: tell the owner of whatever is still running that it will not finish
   here (the gateway retries it elsewhere), the last words before the bus drains;
5. close, in order, whatever happened before: heartbeats off, bus drained, resources.

Every role also gets, from here: its Prometheus metrics server (``--metrics-port``,
off unless set) and its identity on every log line it writes (services/observability.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import ClassVar

from google.protobuf.message import Message
from nats.aio.subscription import Subscription

from protos.epd_pb import bus_pb2
from services import metrics
from services.bus import subjects
from services.bus.connection import Bus
from services.bus.handlers import Handler, Incoming
from services.bus.heartbeat import HeartbeatPublisher, Load
from services.config import ServiceConfig
from services.observability import ObservabilityConfig, identity
from services.runtime import connect_bus
from services.wire import error

log = logging.getLogger(__name__)


class Service:
    """Base of every role: the lifecycle, the heartbeat and the drain."""

    role: ClassVar[str] = ""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.bus: Bus | None = None
        self.heartbeat: HeartbeatPublisher | None = None
        # The model fingerprint heartbeats carry (routers match requests to it).
        self.model_fingerprint = ""
        self.draining = False
        # Work handlers running now (serve_work): the heartbeat's load and the drain's wait.
        self.active = 0
        self._queue_subs: list[Subscription] = []
        self._progress = asyncio.Event()
        self._shutdown: asyncio.Task[None] | None = None
        # Logs and metrics (serve() sets them from flags and EPD_* variables): by
        # default no metrics server; ``metrics_port`` is the bound port once serving.
        self.observability = ObservabilityConfig()
        self.metrics_port = 0
        self._metrics_server = None

    # -- hooks ------------------------------------------------------------------------
    async def load(self) -> None:
        """Load what the role serves with (models, stores); runs before connecting."""

    async def connect(self) -> Bus | None:
        """The bus this instance serves on; None: the role owns no bus (no heartbeat)."""
        return await connect_bus(self.config, self.instance_id)

    async def register(self) -> None:
        """Subscribe the role's handlers (``serve_work`` for work subjects)."""

    def report_load(self) -> Load:
        """This instance's load for its heartbeat (cheap, never blocks)."""
        return Load(running=self.active)

    def busy(self) -> bool:
        """Work in flight besides running handlers (streams, hand-offs, sends)."""
        return False

    async def stop_intake(self) -> None:
        """Take no new work: leave the queue groups (delivered messages are still served)."""
        subs, self._queue_subs = self._queue_subs, []
        await asyncio.gather(*(_leave(sub) for sub in subs))

    async def hand_back(self) -> None:
        """At the end of the grace: tell the owners of unfinished work (bus still open)."""

    async def release(self) -> None:
        """Close what ``load`` and ``register`` opened besides the bus."""

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """metrics -> load -> connect -> register -> heartbeat; ``stop`` undoes any
        prefix of it. Tasks started here log as this service."""
        with identity(self.role, self.instance_id):
            await self._start()

    async def _start(self) -> None:
        self._serve_metrics()
        await self.load()
        self.bus = await self.connect()
        await self.register()
        if self.bus is not None:
            # Answered while the process lives: routers tell a dead instance (no
            # responders at once) from a slow one long before its heartbeats expire.
            await self.bus.subscribe(subjects.ping(self.instance_id), _pong)
            self.heartbeat = HeartbeatPublisher(
                self.bus,
                self.role,
                self.instance_id,
                self._beat_load,
                interval_s=self.config.heartbeat_s,
                model=self.model_fingerprint,
            )
            await self.heartbeat.start()
        log.info("%s %s ready", self.role, self.instance_id)

    async def stop(self) -> None:
        """Drain, then close. Safe to call twice (and concurrently): every call waits for
        the one shutdown, which goes on even when a caller is cancelled."""
        if self._shutdown is None:
            self._shutdown = asyncio.create_task(self._drain_and_close())
        await asyncio.shield(self._shutdown)

    def progressed(self) -> None:
        """Something in flight finished: the drain re-checks whether it is idle."""
        self._progress.set()

    async def serve_work(
        self,
        subject: str,
        handler: Handler,
        refusal: type[Message] | None = None,
        *,
        queue: str | None = None,
        max_concurrency: int = 64,
        while_draining: bool = False,
    ) -> Subscription:
        """Subscribe a work subject whose handlers count as in flight.

        With ``queue`` the subject is left at the drain (replicas share it). Without, a
        message that arrives while draining is answered with ``refusal`` (a reply type
        with an ``error`` field; None: an error header) carrying UNAVAILABLE, unless
        ``while_draining``: the work was routed here before the drain began.
        """
        refuse = queue is None and not while_draining

        async def run(msg: Incoming) -> None:
            if self.draining and refuse:
                await self._refuse(msg, refusal)
                return
            self.active += 1
            try:
                await handler(msg)
            finally:
                self.active -= 1
                self.progressed()

        sub = await self.bus.subscribe(subject, run, queue=queue, max_concurrency=max_concurrency)
        if queue is not None:
            self._queue_subs.append(sub)
        return sub

    # -- inside -----------------------------------------------------------------------
    def _beat_load(self) -> Load:
        load = self.report_load()
        labels = (self.role, self.instance_id)
        metrics.RUNNING.labels(*labels).set(load.running)
        metrics.WAITING.labels(*labels).set(load.waiting)
        metrics.KV_BLOCKS_FREE.labels(*labels).set(load.free_kv_blocks)
        metrics.KV_BLOCKS_USED.labels(*labels).set(load.total_kv_blocks - load.free_kv_blocks)
        return dataclasses.replace(load, draining=self.draining)

    def _serve_metrics(self) -> None:
        port = self.observability.metrics_port
        if port is not None and self._metrics_server is None:
            self._metrics_server = metrics.serve_metrics(port, self.config.host)
            self.metrics_port = self._metrics_server.server_port

    async def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            server, self._metrics_server = self._metrics_server, None
            await asyncio.to_thread(metrics.stop_metrics, server)

    async def _refuse(self, msg: Incoming, refusal: type[Message] | None) -> None:
        text = f"{self.role} instance {self.instance_id} is draining; retry on another instance"
        if refusal is None:
            await msg.respond_error(f"UNAVAILABLE: {text}")
            return
        await msg.respond(refusal(error=error(bus_pb2.ERROR_CODE_UNAVAILABLE, text)))

    async def _drain_and_close(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.shutdown_grace_s
        with identity(self.role, self.instance_id):
            try:
                await self._drain(deadline)
            finally:
                await self._close()

    async def _drain(self, deadline: float) -> None:
        self.draining = True
        if self.heartbeat is not None:
            await self.heartbeat.beat()  # now, not a period later; the loop keeps beating
        log.info(
            "%s %s draining (grace %.1fs)",
            self.role,
            self.instance_id,
            self.config.shutdown_grace_s,
        )
        await _bounded(self.stop_intake(), deadline, "stop intake")
        if not await self._wait_idle(deadline):
            log.warning(
                "%s %s: work still in flight at the end of the grace; handing it back",
                self.role,
                self.instance_id,
            )
        await self.hand_back()

    async def _wait_idle(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while self.active or self.busy():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._progress.clear()  # no await since the check: nothing can slip between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        return True

    async def _close(self) -> None:
        """Each step runs even when one before it failed."""
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("heartbeat", self._stop_heartbeat),
            ("bus", self._close_bus),
            ("resources", self.release),
            ("metrics", self._stop_metrics),
        ]
        for what, step in steps:
            try:
                await step()
            except Exception:
                log.exception("%s %s: closing %s failed", self.role, self.instance_id, what)
        log.info("%s %s stopped", self.role, self.instance_id)

    async def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            await self.heartbeat.stop()  # a last draining beat, then silence

    async def _close_bus(self) -> None:
        if self.bus is not None:
            await self.bus.close()


async def _pong(msg: Incoming) -> None:
    await msg.respond(b"")


async def _leave(sub: Subscription) -> None:
    """Unsubscribe, letting what was already delivered run (nats-py's drain)."""
    try:
        await sub.drain()
    except Exception as e:  # the connection may be gone: nothing left to leave
        log.debug("leaving %s failed: %r", sub.subject, e)


async def _bounded(aw: Awaitable[None], deadline: float, what: str) -> None:
    left = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        await asyncio.wait_for(aw, left)
    except TimeoutError:
        log.warning("%s did not finish within the grace", what)
