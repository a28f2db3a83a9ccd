"""Fixtures for integration tests: private NATS and Redis servers on free ports.

The servers are session-scoped (started once, killed at the end); buses and Redis
clients are per test. ``nats_small`` runs with a 64 KiB max_payload for chunking tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from launch.localstack import ServerProcess, start_nats, start_redis
from services.bus.connection import Bus, BusConfig

SMALL_MAX_PAYLOAD = 64 * 1024

BusFactory = Callable[..., Awaitable[Bus]]


@pytest.fixture(scope="session")
def nats_server() -> Iterator[ServerProcess]:
    """A private nats-server with default limits."""
    with start_nats() as server:
        yield server


@pytest.fixture(scope="session")
def nats_small() -> Iterator[ServerProcess]:
    """A private nats-server whose max_payload is only 64 KiB."""
    with start_nats(max_payload=SMALL_MAX_PAYLOAD) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    """A private redis-server without persistence."""
    with start_redis() as server:
        yield server


@pytest.fixture
async def bus_factory(nats_server: ServerProcess) -> AsyncIterator[BusFactory]:
    """Connect any number of buses (separate connections); all closed at teardown.

    ``await bus_factory()`` connects to ``nats_server``; pass ``server=`` for another.
    """
    buses: list[Bus] = []

    async def connect(server: ServerProcess = nats_server, name: str = "test") -> Bus:
        config = BusConfig(servers=(server.url,), name=name, drain_timeout_s=2.0)
        bus = await Bus.connect(config)
        buses.append(bus)
        return bus

    yield connect
    for bus in buses:
        await bus.close()


@pytest.fixture
async def bus(bus_factory: BusFactory) -> Bus:
    """One bus on the default server."""
    return await bus_factory()


@pytest.fixture
async def redis_client(redis_server: ServerProcess) -> AsyncIterator[aioredis.Redis]:
    """A client on an emptied database of the private Redis."""
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()
