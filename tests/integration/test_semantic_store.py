"""The semantic cache's storage on a real Redis: entries expire, the size bound and the
tenant quota evict the oldest, a replica sees another's writes within a second and
rebuilds its index at start, and with Redis down a lookup is a miss, not an error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from cache_svc.answers import AnswerStore
from cache_svc.config import SemanticCacheConfig
from cache_svc.semantic import SemanticCache
from launch.localstack import free_port, start_redis
from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class Embed:
    """Stand-in for the sentence model where the vectors are the point of the test: a
    fixed unit vector per text, so similarity is chosen, not learnt."""

    async def embed(self, text: str) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(text.split("#")[0])) % (1 << 32))
        vec = rng.standard_normal(384).astype(np.float32)
        return vec / np.linalg.norm(vec)


def query(text: str, tenant: str = "", fp: str = "a" * 64) -> bus_pb2.CacheQuery:
    import hashlib

    return bus_pb2.CacheQuery(
        fingerprint=fp,
        exact_key=hashlib.sha256(text.encode()).hexdigest(),
        text=text,
        max_tokens=16,
        tenant=tenant,
    )


def store(text: str, **kw) -> bus_pb2.CacheStoreRequest:
    answer = bus_pb2.CachedAnswer(max_tokens=16)
    answer.choices.add(index=0, token_ids=[5, 6, 7], finish_reason=pb.FINISH_REASON_STOP)
    return bus_pb2.CacheStoreRequest(query=query(text, **kw), answer=answer)


@pytest_asyncio.fixture(loop_scope="module")
async def redis_url(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    return redis_server.url


async def open_cache(url: str, **kw) -> SemanticCache:
    cache = SemanticCache(AnswerStore(url, follow_block_ms=100), Embed(), SemanticCacheConfig(**kw))
    await cache.start()
    return cache


async def test_replicas_follow_each_other_and_rebuild(redis_url):
    a, b = await open_cache(redis_url), await open_cache(redis_url)
    try:
        assert (await a.put(store("question one"))).stored
        for _ in range(20):  # b follows a's writes through the change log
            if len(b.index) == 1:
                break
            await asyncio.sleep(0.05)
        assert len(b.index) == 1
        hit = await b.lookup(query("question one#paraphrased"))  # same vector, other text
        assert hit.hit and hit.tier == "semantic" and hit.similarity > 0.99
        c = await open_cache(redis_url)  # a new replica rebuilds from Redis
        assert len(c.index) == 1 and (await c.lookup(query("question one"))).tier == "exact"
        await c.stop()
    finally:
        await a.stop()
        await b.stop()


async def test_a_bucket_past_ann_from_becomes_a_graph_and_a_replica_rebuilds_it(redis_url):
    a = await open_cache(redis_url, cache_ann_from=8)
    try:
        for i in range(12):
            assert (await a.put(store(f"question {i}"))).stored
        for _ in range(100):  # the graph is built in a thread
            if type(a.index._buckets["a" * 64]).__name__ == "Graph":
                break
            await asyncio.sleep(0.02)
        assert type(a.index._buckets["a" * 64]).__name__ == "Graph"
        hit = await a.lookup(query("question 11#paraphrased"))
        assert hit.hit and hit.tier == "semantic"
        b = await open_cache(redis_url, cache_ann_from=8)  # rebuilt in bulk from Redis
        assert len(b.index) == 12 and type(b.index._buckets["a" * 64]).__name__ == "Graph"
        assert (await b.lookup(query("question 2#paraphrased"))).tier == "semantic"
        await b.stop()
    finally:
        await a.stop()


async def test_ttl_size_bound_and_tenant_quota(redis_url):
    cache = await open_cache(redis_url, cache_ttl_s=1, cache_max_entries=3, cache_tenant_quota=2)
    try:
        for i in range(4):
            await cache.put(store(f"bounded {i}"))
        assert [(await cache.lookup(query(f"bounded {i}"))).hit for i in range(4)] == [
            False,
            True,
            True,
            True,
        ]
        for i in range(3):
            await cache.put(store(f"tenant {i}", tenant="t1"))
        assert not (await cache.lookup(query("tenant 0", tenant="t1"))).hit
        assert (await cache.lookup(query("tenant 2", tenant="t1"))).hit
        await asyncio.sleep(1.3)
        assert not (await cache.lookup(query("tenant 2", tenant="t1"))).hit  # expired
    finally:
        await cache.stop()


async def test_other_fingerprints_and_max_tokens_do_not_hit(redis_url):
    cache = await open_cache(redis_url)
    try:
        await cache.put(store("fingerprinted"))
        assert not (await cache.lookup(query("fingerprinted", fp="b" * 64))).hit
        longer = query("fingerprinted")
        longer.max_tokens = 2  # the stored answer has 3 tokens
        assert not (await cache.lookup(longer)).hit
    finally:
        await cache.stop()


async def test_redis_down_is_a_miss_not_an_error():
    server = start_redis()
    cache = await open_cache(server.url)
    try:
        await cache.put(store("while up"))
        server.stop()
        reply = await cache.lookup(query("while up"))
        assert not reply.hit and reply.HasField("error")
        assert not (await cache.put(store("while down"))).stored
    finally:
        await cache.stop()
    dead = await open_cache(f"redis://127.0.0.1:{free_port()}/0")  # never up: starts anyway
    try:
        assert not (await dead.lookup(query("anything"))).hit
    finally:
        await dead.stop()


async def test_malformed_messages_are_refused(redis_url):
    cache = await open_cache(redis_url)
    try:
        bad = query("x")
        bad.fingerprint = "not-hex"
        assert (await cache.lookup(bad)).HasField("error")
        req = store("y")
        req.answer.ClearField("choices")
        reply = await cache.put(req)
        assert not reply.stored and "choices" in reply.error.message
        assert (await cache.put(store("fine"))).stored  # and it keeps serving
    finally:
        await cache.stop()
