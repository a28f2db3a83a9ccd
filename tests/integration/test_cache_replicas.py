"""Two cache service replicas on real NATS and Redis: an exact miss starts embedding the
question on the replica that answered it and names it; the gateway's full lookup goes
there and costs no second pass, and when that replica is gone any other one answers."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import pytest_asyncio

from cache_svc.config import SemanticCacheConfig
from cache_svc.service import CacheService
from gateway.cache_client import BusCacheClient
from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb
from services.bus.connection import Bus, BusConfig
from tests.integration.stack import service_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class Counting:
    """A replica's sentence model, counting the texts it embeds."""

    def __init__(self, embedder) -> None:
        self.embedder, self.texts = embedder, []

    def __call__(self, texts):
        self.texts += texts
        return self.embedder(texts)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(nats_server, redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    config = SemanticCacheConfig(cache_lookup_timeout_ms=5000)
    services = [
        CacheService(service_config(nats_server.url, redis_server.url, name), config)
        for name in ("cache-r1", "cache-r2")
    ]
    for s in services:
        await s.start()
    counters = {}
    for s in services:
        batcher = s.cache.embed
        counters[s.instance_id] = batcher.embedder = Counting(batcher.embedder)
    bus = await Bus.connect(BusConfig(servers=(nats_server.url,), name="replicas-test"))
    yield services, counters, BusCacheClient(bus)
    await bus.close()
    for s in services:
        await s.stop()


def _query(text: str, exact_only: bool) -> bus_pb2.CacheQuery:
    return bus_pb2.CacheQuery(
        fingerprint="f" * 64,
        exact_key=hashlib.sha256(text.encode()).hexdigest(),
        text=text,
        max_tokens=16,
        exact_only=exact_only,
    )


async def _stored(services, client: BusCacheClient, text: str) -> None:
    """Stored, and in every replica's index (the other one follows the change log)."""
    before = [len(s.cache.index) for s in services]
    answer = bus_pb2.CachedAnswer(max_tokens=16)
    answer.choices.add(index=0, token_ids=[5, 6, 7], finish_reason=pb.FINISH_REASON_STOP)
    reply = await client.store(
        bus_pb2.CacheStoreRequest(query=_query(text, False), answer=answer), 5.0
    )
    assert reply.stored
    for _ in range(100):
        if all(len(s.cache.index) > n for s, n in zip(services, before, strict=True)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a replica's index did not follow the store")


async def test_the_full_lookup_reuses_the_exact_misses_embedding(replicas):
    services, counters, client = replicas
    await _stored(services, client, "How tall is the Eiffel Tower?")
    asks = [
        "What is the height of the Eiffel Tower?",
        "Tell me how tall the Eiffel Tower is.",
        "How tall is the Eiffel Tower in Paris?",
        "What's the Eiffel Tower's height?",
    ]
    for asked in asks:  # the queue group spreads exact lookups over both replicas
        miss = await client.lookup(_query(asked, True), 5.0)
        assert not miss.hit and miss.embedding_on in counters
        full = await client.lookup(_query(asked, False), 5.0, replica=miss.embedding_on)
        assert full.hit and full.tier == "semantic"
        passes = {name: c.texts.count(asked) for name, c in counters.items()}
        assert passes == {name: int(name == miss.embedding_on) for name in counters}


async def test_a_replica_that_is_gone_is_replaced_by_any_other(replicas):
    services, _, client = replicas
    await _stored(services, client, "Who wrote Hamlet?")
    full = await client.lookup(
        _query("Who is the author of Hamlet?", False), 5.0, replica="cache-gone"
    )
    assert full.hit and full.tier == "semantic"
