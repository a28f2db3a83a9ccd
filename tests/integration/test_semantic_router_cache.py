"""The semantic cache reuses the router's embedding: a lookup or a store that carries the
query's vector (CacheQuery.vector, sent by a gateway whose router embedded the message)
costs no embedding pass in the cache service, and finds what an embedded text finds; a
malformed vector is refused as a value (the lookup is a miss), never used."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import pytest_asyncio

from cache_svc.answers import AnswerStore
from cache_svc.config import SemanticCacheConfig
from cache_svc.semantic import SemanticCache
from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class Counting:
    """A chosen unit vector per text (its first word picks the axis); counts passes."""

    def __init__(self):
        self.calls = 0

    async def embed(self, text: str) -> np.ndarray:
        self.calls += 1
        return vector_of(text)


def vector_of(text: str) -> np.ndarray:
    vec = np.zeros(384, np.float32)
    vec[sum(map(ord, text.split()[0])) % 384] = 1.0
    return vec


def query(text: str, vector: bytes = b"") -> bus_pb2.CacheQuery:
    return bus_pb2.CacheQuery(
        fingerprint="c" * 64,
        text=text,
        max_tokens=8,
        vector=vector,
        exact_key=hashlib.sha256(text.encode()).hexdigest(),
    )


@pytest_asyncio.fixture(loop_scope="module")
async def cache(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    embed = Counting()
    c = SemanticCache(
        AnswerStore(redis_server.url, follow_block_ms=100),
        embed,
        SemanticCacheConfig(cache_threshold=0.9),
    )
    await c.start()
    yield c, embed
    await c.stop()


async def test_a_given_vector_saves_the_embedding_pass(cache):
    c, embed = cache
    answer = bus_pb2.CachedAnswer(max_tokens=8)
    answer.choices.add(index=0, token_ids=[1, 2], finish_reason=pb.FINISH_REASON_STOP)
    given = vector_of("capital of france").tobytes()
    stored = await c.put(
        bus_pb2.CacheStoreRequest(query=query("capital of france?", given), answer=answer)
    )
    assert stored.stored and embed.calls == 0
    hit = await c.lookup(query("capital of France, please", vector_of("capital x").tobytes()))
    assert hit.hit and hit.tier == "semantic" and embed.calls == 0
    plain = await c.lookup(query("capital of France, tell me"))  # no vector: embedded here
    assert plain.hit and embed.calls == 1


@pytest.mark.parametrize(
    "bad", [b"\x00" * 10, np.zeros(384, "<f4").tobytes(), np.full(384, np.nan, "<f4").tobytes()]
)
async def test_a_malformed_vector_is_refused(cache, bad):
    c, embed = cache
    reply = await c.lookup(query("anything at all", bad))
    assert not reply.hit and reply.error.code == bus_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert "vector" in reply.error.message
