"""The Redis embedding cache: round trip with TTL, corrupt values and a dead Redis read
as misses without exceptions, and concurrent requests for one image encode it once."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
import torch

from launch.localstack import ServerProcess, free_port, start_redis
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig, embedding_key
from services.singleflight import SingleFlight

FP = "demo-vit.v1"
IMAGE = hashlib.sha256(b"a product photo").hexdigest()


def _store(url: str, **kw: float) -> EmbeddingStore:
    return EmbeddingStore.from_config(EmbeddingStoreConfig(url=url, **kw))


async def test_round_trip_and_ttl(
    redis_server: ServerProcess, redis_client: aioredis.Redis
) -> None:
    store = _store(redis_server.url)
    assert await store.get(FP, IMAGE) is None
    embedding = torch.randn(64, 48).to(torch.bfloat16)
    assert await store.put(FP, IMAGE, embedding, ttl_s=120) is True
    got = await store.get(FP, IMAGE)
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, embedding)
    assert 0 < await redis_client.ttl(embedding_key(FP, IMAGE)) <= 120
    assert await store.get("other-model", IMAGE) is None  # the fingerprint is in the key
    await store.close()
    await store.close()


async def test_corrupt_value_is_a_logged_miss(
    redis_server: ServerProcess, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(redis_server.url)
    await redis_client.set(embedding_key(FP, IMAGE), b"EPDE\x01garbage")
    with caplog.at_level(logging.WARNING):
        assert await store.get(FP, IMAGE) is None
    assert "corrupt embedding" in caplog.text
    await store.close()


async def test_unreachable_redis_is_a_miss() -> None:
    store = _store(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.2, backoff_s=0.0)
    started = time.monotonic()
    assert await store.get(FP, IMAGE) is None
    assert await store.put(FP, IMAGE, torch.zeros(2, 2)) is False
    assert time.monotonic() - started < 2.0
    await store.close()


async def test_redis_dying_mid_use_is_a_miss_then_backs_off() -> None:
    with start_redis() as server:
        store = _store(server.url, op_timeout_s=0.2, backoff_s=30.0)
        assert await store.put(FP, IMAGE, torch.ones(3)) is True
        server.stop()
        assert await store.get(FP, IMAGE) is None
        started = time.monotonic()  # backing off: no network call at all
        assert await store.put(FP, IMAGE, torch.ones(3)) is False
        assert time.monotonic() - started < 0.05
        await store.close()


async def test_singleflight_encodes_once_for_ten_concurrent_requests(
    redis_server: ServerProcess, redis_client: aioredis.Redis
) -> None:
    store = _store(redis_server.url)
    group: SingleFlight[str, torch.Tensor] = SingleFlight()
    encodes = 0
    gate = asyncio.Event()

    async def encode_and_store() -> torch.Tensor:
        nonlocal encodes
        encodes += 1
        await gate.wait()  # every caller joins while the "vision tower" runs
        embedding = torch.full((4, 8), 7.0)
        await store.put(FP, IMAGE, embedding)
        return embedding

    async def get_embedding() -> torch.Tensor:
        cached = await store.get(FP, IMAGE)
        if cached is not None:
            return cached
        return await group.do(embedding_key(FP, IMAGE), encode_and_store)

    callers = [asyncio.create_task(get_embedding()) for _ in range(10)]
    await asyncio.wait_for(_until(lambda: group.waiters(embedding_key(FP, IMAGE)) == 10), 5)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*callers), 5)
    assert encodes == 1 and all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(await get_embedding(), results[0]) and encodes == 1  # now a hit
    await store.close()


async def _until(cond: Callable[[], bool]) -> None:
    """Poll a condition (callers bound this with a timeout)."""
    while not cond():
        await asyncio.sleep(0.005)
