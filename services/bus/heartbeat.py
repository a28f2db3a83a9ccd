"""Heartbeats carrying load, and the registry of live instances that routers read.

Every instance publishes a Heartbeat each ``interval_s`` on ``epd.hb.<role>.<id>``.
An InstanceRegistry keeps the latest one per instance and forgets instances silent for
``expiry_s`` (local receive time, so sender clock skew does not matter). Choosing among
them is the gateway's router (gateway/router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.connection import Bus, Incoming
from services.bus.deadline import now_unix_ms
from services.bus.errors import BusError, BusTimeout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """An instance's load, as reported in its heartbeat."""

    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    # Shutting down: routers send no new work.
    draining: bool = False
    # Work finished so far (engine steps); 0 where a service does not count it.
    steps: int = 0


class HeartbeatPublisher:
    """Publishes this instance's heartbeat every ``interval_s`` with load from ``load_fn``."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        instance_id: str,
        load_fn: Callable[[], Load],
        *,
        interval_s: float = 1.0,
        model: str = "",
    ) -> None:
        """``load_fn`` is called once per beat; it must be cheap and must not block."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._bus = bus
        self._subject = subjects.heartbeat(role, instance_id)
        self._role, self._instance_id, self._model = role, instance_id, model
        self._load_fn = load_fn
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Publish the first heartbeat now, then keep beating in the background."""
        if self._task is None:
            await self.beat()
            self._task = asyncio.create_task(self._loop(), name=f"heartbeat-{self._subject}")

    async def stop(self, *, announce: bool = True) -> None:
        """Stop beating. ``announce`` sends a last ``draining`` beat so routers stop at
        once; without it the instance just goes silent and expires. Safe twice."""
        if self._task is None:
            return
        task, self._task = self._task, None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if announce:
            await self.beat(draining=True)

    async def beat(self, *, draining: bool = False) -> None:
        """Publish one heartbeat; failures are logged, never raised."""
        try:
            load = self._load_fn()
            msg = bus_pb2.Heartbeat(
                role=self._role,
                instance_id=self._instance_id,
                running=load.running,
                waiting=load.waiting,
                free_kv_blocks=load.free_kv_blocks,
                total_kv_blocks=load.total_kv_blocks,
                unix_ms=now_unix_ms(),
                draining=load.draining or draining,
                model=self._model,
                steps=load.steps,
            )
            await self._bus.publish(self._subject, msg)
        except (BusError, ValueError, TypeError) as exc:
            logger.warning("heartbeat %s not sent: %r", self._subject, exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.beat()


@dataclass
class InstanceInfo:
    """Latest known state of one instance."""

    role: str
    instance_id: str
    load: Load
    model: str
    # Local monotonic time the last heartbeat arrived.
    last_seen: float
    # Local monotonic time its step count last moved (first heard, if it never did).
    progressed_at: float = 0.0


class InstanceRegistry:
    """Live instances per role, fed by heartbeats."""

    def __init__(
        self,
        bus: Bus,
        roles: Iterable[str],
        *,
        expiry_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Track heartbeats of ``roles``; forget instances silent for ``expiry_s``."""
        if expiry_s <= 0:
            raise ValueError(f"expiry_s must be > 0, got {expiry_s}")
        self._bus = bus
        self._roles = tuple(roles)
        self._expiry_s = expiry_s
        self._clock = clock
        self._instances: dict[str, dict[str, InstanceInfo]] = {r: {} for r in self._roles}
        self._subs: list[Subscription] = []
        self._changed = asyncio.Event()
        # When the last heartbeat of any instance arrived (None: none yet).
        self._heard_at: float | None = None

    async def start(self) -> None:
        """Subscribe to the heartbeats of every tracked role."""
        for role in self._roles:
            self._subs.append(
                await self._bus.subscribe(subjects.heartbeat_wildcard(role), self._on_msg)
            )

    async def stop(self) -> None:
        """Unsubscribe. Safe to call twice."""
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def record(self, hb: bus_pb2.Heartbeat) -> None:
        """Take one heartbeat into account."""
        if hb.role not in self._instances:
            return
        load = Load(
            hb.running, hb.waiting, hb.free_kv_blocks, hb.total_kv_blocks, hb.draining, hb.steps
        )
        self._heard_at = self._clock()
        before = self._instances[hb.role].get(hb.instance_id)
        moved = before is None or before.load.steps != hb.steps
        self._instances[hb.role][hb.instance_id] = InstanceInfo(
            hb.role,
            hb.instance_id,
            load,
            hb.model,
            self._heard_at,
            self._heard_at if moved else before.progressed_at,
        )
        self._changed.set()

    def progressed_at(self, role: str, instance_id: str) -> float | None:
        """When the instance's step count last moved (local monotonic time); None if
        unknown. A long queue before a request's first token is not a stall while this
        moves."""
        info = self._instances.get(role, {}).get(instance_id)
        return None if info is None else info.progressed_at

    def live(self, role: str, *, include_draining: bool = False) -> list[InstanceInfo]:
        """Instances of ``role`` heard from within the expiry, sorted by id."""
        table = self._instances[role]
        cutoff = self._silence_reference() - self._expiry_s
        for iid in [iid for iid, info in table.items() if info.last_seen < cutoff]:
            logger.info("instance %s/%s expired (silent > %.1fs)", role, iid, self._expiry_s)
            del table[iid]
        infos = sorted(table.values(), key=lambda i: i.instance_id)
        return [i for i in infos if include_draining or not i.load.draining]

    def _silence_reference(self) -> float:
        """The time silence is measured to. When no instance at all was heard for longer
        than the expiry, this process most likely stalled (a blocked event loop: the
        heartbeats wait unread on the socket) rather than the whole fleet dying at once:
        silence then counts only up to the last heartbeat heard, for 3 expiries; past
        that the fleet is taken as gone."""
        now = self._clock()
        if self._heard_at is None or now - self._heard_at <= self._expiry_s:
            return now
        if now - self._heard_at > 3 * self._expiry_s:
            return now - 2 * self._expiry_s
        return self._heard_at

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``predicate()`` holds; re-checked on heartbeats and on expiry ticks."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        tick = self._expiry_s / 10
        while not predicate():
            left = deadline - loop.time()
            if left <= 0:
                raise BusTimeout("registry condition", timeout_s)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(tick, left))

    async def _on_msg(self, msg: Incoming) -> None:
        hb = msg.decode(bus_pb2.Heartbeat)
        if msg.subject != subjects.heartbeat(hb.role, hb.instance_id):
            raise ValueError(f"heartbeat of {hb.role}/{hb.instance_id} on {msg.subject}")
        self.record(hb)
