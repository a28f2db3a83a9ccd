"""A prefill whose engine keeps stepping is busy, not stalled: a request queued behind
others for longer than the stall timeout stays with it; one whose prefill stopped stepping
moves on, and so does one whose decode went silent. Heartbeats carry the step count; the
registry notes when it last moved."""

from __future__ import annotations

import time

import pytest

from gateway.attempt import Route, WorkerLost, _check
from gateway.reorder import UpdateOrderer
from protos.epd_pb import bus_pb2
from services.bus.heartbeat import InstanceRegistry
from tests.helpers.stall_watch import Clock, Watch

STALL_S = 30.0


def _beat(registry: InstanceRegistry, steps: int) -> None:
    registry.record(bus_pb2.Heartbeat(role="prefill", instance_id="p0", steps=steps))


def _registry(clock: Clock) -> InstanceRegistry:
    registry = InstanceRegistry(None, ["prefill", "decode"], expiry_s=1e9, clock=clock)
    registry.record(bus_pb2.Heartbeat(role="decode", instance_id="d0"))
    return registry


def test_progress_time_moves_only_with_the_step_count():
    clock = Clock()
    registry = _registry(clock)
    _beat(registry, steps=7)
    first = registry.progressed_at("prefill", "p0")
    clock.offset = 5.0
    _beat(registry, steps=7)
    assert registry.progressed_at("prefill", "p0") == first
    clock.offset = 9.0
    _beat(registry, steps=8)
    assert registry.progressed_at("prefill", "p0") == pytest.approx(first + 9.0, abs=0.5)
    assert registry.progressed_at("prefill", "unknown") is None


def test_a_queued_request_on_a_stepping_worker_is_not_a_stall():
    clock = Clock()
    registry = _registry(clock)
    clock.offset = -40.0  # first heard 40 s ago, stepping ever since
    _beat(registry, steps=1)
    clock.offset = 0.0
    _beat(registry, steps=500)
    last_update = time.monotonic() - 2 * STALL_S
    route = Route("p0", "d0", 0)
    role, worker = _check(
        route, UpdateOrderer(), time.time() + 300, STALL_S, Watch(registry), last_update
    )
    assert (role, worker) == ("prefill", "p0")


def test_a_worker_that_stopped_stepping_is_left():
    clock = Clock()
    registry = _registry(clock)
    clock.offset = -40.0
    _beat(registry, steps=3)
    clock.offset = 0.0
    _beat(registry, steps=3)  # still beating (its event loop lives), its engine does not
    last_update = time.monotonic() - 2 * STALL_S
    with pytest.raises(WorkerLost, match="no engine steps"):
        _check(
            Route("p0", "d0", 0),
            UpdateOrderer(),
            time.time() + 300,
            STALL_S,
            Watch(registry),
            last_update,
        )


def test_a_silent_decode_is_left_even_while_its_engine_steps():
    clock = Clock()
    registry = _registry(clock)
    clock.offset = -40.0
    registry.record(bus_pb2.Heartbeat(role="decode", instance_id="d0", steps=1))
    clock.offset = 0.0
    registry.record(bus_pb2.Heartbeat(role="decode", instance_id="d0", steps=900))
    _beat(registry, steps=1)
    route = Route("p0", "d0", 0, decode_spoke=True)
    with pytest.raises(WorkerLost, match="decode instance d0"):
        _check(
            route,
            UpdateOrderer(),
            time.time() + 300,
            STALL_S,
            Watch(registry),
            time.monotonic() - 2 * STALL_S,
        )
