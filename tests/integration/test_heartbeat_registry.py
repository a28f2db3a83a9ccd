"""Heartbeats reach the registry, which drops draining instances at once and silent ones
after expiry; the gateway's router routes on it to the least-loaded live instance and
round-robins ties."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.config import GatewayConfig
from gateway.events import BackendError
from gateway.router import Router
from services.bus.heartbeat import HeartbeatPublisher, InstanceRegistry, Load
from tests.integration.conftest import BusFactory

EXPIRY_S = 0.4


async def _publisher(factory: BusFactory, iid: str, load: Load) -> HeartbeatPublisher:
    bus = await factory(name=iid)
    pub = HeartbeatPublisher(bus, "decode", iid, lambda: load, interval_s=0.05, model="demo")
    await pub.start()
    return pub


async def _registry(factory: BusFactory) -> InstanceRegistry:
    bus = await factory(name="router")
    registry = InstanceRegistry(bus, ["decode", "prefill"], expiry_s=EXPIRY_S)
    await registry.start()
    await bus.flush()
    return registry


def _ids(registry: InstanceRegistry) -> set[str]:
    return {i.instance_id for i in registry.live("decode")}


async def test_least_loaded_with_round_robin_on_ties(bus_factory: BusFactory) -> None:
    registry = await _registry(bus_factory)
    router = Router(registry, "demo", GatewayConfig(router_policy="least_loaded"))
    with pytest.raises(BackendError, match="no live decode"):
        router.pick("decode")
    busy = Load(running=8, waiting=2, free_kv_blocks=10, total_kv_blocks=100)
    idle = Load(running=1, free_kv_blocks=90, total_kv_blocks=100)
    pubs = [
        await _publisher(bus_factory, "d-busy", busy),
        await _publisher(bus_factory, "d-a", idle),
        await _publisher(bus_factory, "d-b", idle),
    ]
    await registry.wait_for(lambda: len(_ids(registry)) == 3, timeout_s=5)
    info = {i.instance_id: i for i in registry.live("decode")}
    assert info["d-busy"].load == busy and info["d-a"].model == "demo"
    assert registry.live("prefill") == []
    picks = Counter(router.pick("decode").instance_id for _ in range(4))
    assert picks == Counter({"d-a": 2, "d-b": 2})  # ties alternate, busy never chosen
    with pytest.raises(BackendError):
        Router(registry, "other", GatewayConfig()).pick("decode")
    for pub in pubs:
        await pub.stop()


async def test_draining_instance_leaves_at_once(bus_factory: BusFactory) -> None:
    registry = await _registry(bus_factory)
    pub = await _publisher(bus_factory, "d-0", Load())
    await registry.wait_for(lambda: _ids(registry) == {"d-0"}, timeout_s=5)
    await pub.stop()  # announces draining
    await pub.stop()  # safe twice
    await registry.wait_for(lambda: not _ids(registry), timeout_s=EXPIRY_S / 2)
    assert [i.instance_id for i in registry.live("decode", include_draining=True)] == ["d-0"]


async def test_silent_instance_expires(bus_factory: BusFactory) -> None:
    registry = await _registry(bus_factory)
    keep = await _publisher(bus_factory, "d-keep", Load())
    gone = await _publisher(bus_factory, "d-gone", Load())
    await registry.wait_for(lambda: _ids(registry) == {"d-keep", "d-gone"}, timeout_s=5)
    await gone.stop(announce=False)  # crashes: no goodbye, just silence
    await registry.wait_for(lambda: _ids(registry) == {"d-keep"}, timeout_s=EXPIRY_S * 10)
    assert Router(registry, "demo", GatewayConfig()).pick("decode").instance_id == "d-keep"
    await keep.stop()


async def test_wait_for_times_out(bus_factory: BusFactory) -> None:
    registry = await _registry(bus_factory)
    with pytest.raises(TimeoutError):
        await registry.wait_for(lambda: bool(_ids(registry)), timeout_s=0.1)
