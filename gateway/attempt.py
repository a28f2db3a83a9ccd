"""One attempt of one choice on the fleet: prefill on one instance, decode on another.

An attempt ends with the request finished, with a ``BackendError`` (the request itself
is at fault, or its deadline passed), or with ``WorkerLost``: the worker holding it is
gone or refused it, and the choice may continue elsewhere (gateway/disaggregated.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.events import BackendError, TokenEvent
from gateway.reorder import UpdateOrderer
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.wire import STATUS

# How often a waiting request checks that its workers are still alive.
LIVENESS_TICK_S = 0.25
# After this long without an update the worker is pinged: a dead one answers "no
# responders" at once, where its heartbeats take instance_ttl_s to expire.
PROBE_AFTER_S = 0.5
# Failures that say "this worker cannot do it now", not "this request is wrong".
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})


class WorkerWatch(Protocol):
    """What an attempt asks about the workers it waits on (the fleet link answers from
    the heartbeat registry and the ping subject: gateway/fleet_link.py)."""

    def alive(self, role: str, instance_id: str) -> bool: ...
    def progressed_at(self, role: str, instance_id: str) -> float | None: ...
    async def answers_ping(self, role: str, instance_id: str) -> bool: ...


class WorkerLost(Exception):
    """The ``role`` worker of an attempt died, stalled or refused; try another."""

    def __init__(self, role: str, instance_id: str, reason: str):
        super().__init__(f"{role} instance {instance_id}: {reason}")
        self.role, self.instance_id = role, instance_id


@dataclass
class Route:
    """Where an attempt's token updates may come from, and where they go."""

    prefill_id: str
    decode_id: str
    # Offset of the attempt's first token (tokens the client had before it).
    start: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Decode has sent something: the hand-off is over, prefill no longer matters.
    decode_spoke: bool = False
    # Conditional disaggregation: the decode instance prefills too (prefill_id == decode_id).
    local: bool = False

    def accepts(self, sender: str, upd: bus_pb2.TokenUpdate) -> bool:
        """Only the assigned workers speak for the request: prefill its first token
        (or a failure), decode the rest."""
        if sender == self.decode_id:
            return upd.offset >= self.start or upd.HasField("error")
        if sender != self.prefill_id or self.decode_spoke:  # prefill is done once decode speaks
            return False
        # its first token, or a failure (of the prefill or of the hand-off that follows)
        return upd.offset == self.start or upd.HasField("error")


async def while_alive(
    aw,
    alive: Callable[[], bool],
    lost: Callable[[], WorkerLost],
    probe: Callable[[], Awaitable[bool]] | None = None,
    stalled: Callable[[], WorkerLost | None] | None = None,
):
    """Await ``aw``; raise ``lost()`` as soon as ``alive()`` turns false, or ``probe()``
    (tried every PROBE_AFTER_S while waiting) says the worker is gone; raise what
    ``stalled()`` returns once it returns something (a live worker that stopped working)."""
    task = asyncio.ensure_future(aw)
    probed = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_TICK_S)
            if done:
                return task.result()
            if not alive():
                raise lost()
            stall = stalled() if stalled is not None else None
            if stall is not None:
                raise stall
            if probe is not None and time.monotonic() - probed > PROBE_AFTER_S:
                probed = time.monotonic()
                if not await probe():
                    raise lost()
    finally:
        task.cancel()


def update_error(upd: bus_pb2.TokenUpdate, route: Route, sender: str, started: bool):
    """The exception an error update stands for: WorkerLost when another instance may
    succeed (the decode is blamed once prefill sent the token: the hand-off failed)."""
    code = STATUS.get(upd.error.code, "INTERNAL")
    if code not in RETRYABLE:
        return BackendError(code, upd.error.message)
    if sender == route.decode_id or started:
        return WorkerLost(subjects.ROLE_DECODE, route.decode_id, upd.error.message)
    return WorkerLost(subjects.ROLE_PREFILL, route.prefill_id, upd.error.message)


async def stream_updates(
    route: Route, order: UpdateOrderer, deadline: float, stall_s: float, fleet: WorkerWatch
) -> AsyncIterator[TokenEvent]:
    """The attempt's events in order, until it finishes or fails."""
    last = probed = time.monotonic()
    while True:
        try:
            sender, upd = await asyncio.wait_for(route.queue.get(), LIVENESS_TICK_S)
        except TimeoutError:
            role, worker = _check(route, order, deadline, stall_s, fleet, last)
            now = time.monotonic()
            if now - max(last, probed) > PROBE_AFTER_S:
                probed = now
                if not await fleet.answers_ping(role, worker):
                    raise WorkerLost(role, worker, "its connection is gone") from None
            continue
        last = time.monotonic()
        if time.time() > deadline:  # checked on every update too: a stream never outlives it
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline")
        route.decode_spoke |= sender == route.decode_id
        if upd.HasField("error"):
            raise update_error(upd, route, sender, order.started)
        for ready in order.push(upd):
            event = order.event(ready)
            yield event
            if event.finish_reason is not None:
                return


def _check(
    route: Route,
    order: UpdateOrderer,
    deadline: float,
    stall_s: float,
    fleet: WorkerWatch,
    last: float,
) -> tuple[str, str]:
    """Raise if the attempt cannot go on; else the (role, id) of the worker it waits on."""
    if time.time() > deadline:
        raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline")
    # Prefill holds the request until its first token, and the KV until decode speaks.
    watched = (
        [] if route.decode_spoke or route.local else [(subjects.ROLE_PREFILL, route.prefill_id)]
    )
    if order.started or route.decode_spoke or route.local:
        watched.append((subjects.ROLE_DECODE, route.decode_id))
    for role, worker in watched:
        if not fleet.alive(role, worker):
            raise WorkerLost(role, worker, "went away mid-request")
    role, worker = watched[-1]
    # A prefill whose engine keeps stepping is busy (a long queue before this request's
    # first token), not stalled: the request's deadline bounds that wait. Decode runs
    # every request it holds each step, so there silence alone means a stall.
    busy_at = (fleet.progressed_at(role, worker) if role == subjects.ROLE_PREFILL else None) or 0.0
    if time.monotonic() - max(last, busy_at) > stall_s:
        raise WorkerLost(role, worker, f"no tokens and no engine steps for {stall_s:.0f}s")
    return role, worker
