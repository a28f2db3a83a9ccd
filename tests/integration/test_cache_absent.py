"""A fleet without a cache service: the gateway learns it from one "no responders" and
stops asking for a while, so requests do not pay the bus's no-responders grace."""

from __future__ import annotations

import pytest

from gateway.cache_client import BusCacheClient
from protos.epd_pb import bus_pb2
from services.bus.errors import BusUnavailable, NoResponders


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_no_cache_service_is_remembered_for_absent_s(bus_factory):
    bus, clock = await bus_factory(), Clock()
    client = BusCacheClient(bus, absent_s=2.0, clock=clock)
    with pytest.raises(NoResponders):
        await client.lookup(bus_pb2.CacheQuery(exact_key="k"), timeout_s=1.0)
    await bus.close()  # any further request would now fail with BusUnavailable
    with pytest.raises(NoResponders):  # answered from memory, without the bus
        await client.store(bus_pb2.CacheStoreRequest(), timeout_s=1.0)
    clock.t = 2.5  # the memory expired: it asks the bus again
    with pytest.raises(BusUnavailable):
        await client.lookup(bus_pb2.CacheQuery(exact_key="k"), timeout_s=1.0)
