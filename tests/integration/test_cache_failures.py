"""A cache that fails is a miss: with the cache service stopped, or Redis killed in the
middle, every request is still served (text and images), and the gateway counts it."""

from __future__ import annotations

import asyncio
import base64
import io

import openai
import pytest
import pytest_asyncio

from cache_svc.config import SemanticCacheConfig
from cache_svc.service import CacheService
from launch.localstack import start_redis
from services.config import EngineConfig
from services.metrics import GATEWAY_CACHE
from tests.helpers.checkpoints import random_image
from tests.integration.stack import service_config, start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory, nats_server):
    redis = start_redis()
    on = SemanticCacheConfig(cache_lookup_timeout_ms=500, cache_exact_timeout_ms=500)
    engine = EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=256
    )
    cache = CacheService(service_config(nats_server.url, redis.url, "cache-f"), on)
    await cache.start()
    stack = await start_disaggregated(
        engine, nats_server.url, redis.url, "cf", num_decode=1, cache=on
    )
    yield stack, cache, redis
    await stack.stop()
    await cache.stop()
    redis.stop()


def image_message(seed: int) -> list[dict]:
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is it?"},
            ],
        }
    ]


async def ask(client, messages):
    raw = await client.chat.completions.with_raw_response.create(
        model="demo", messages=messages, temperature=0, max_tokens=5
    )
    return raw.headers["x-epd-cache"], raw.parse().choices[0].message.content


async def test_requests_survive_the_cache_and_redis_going_away(fleet):
    stack, cache, redis = fleet
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.gateway.http_port}/v1", api_key="none", max_retries=0
    )
    text = [{"role": "user", "content": "Name a color of the rainbow."}]
    status, answer = await ask(client, text)
    assert status == "miss" and answer
    await asyncio.gather(*list(stack.gateway.core.cache._tasks))  # the answer is stored
    assert (await ask(client, text))[0] == "hit-exact"
    redis.stop()  # Redis killed: cache misses, embeddings travel as blobs to prefill
    for seed in range(3):
        status, answer = await ask(client, text if seed % 2 else image_message(seed))
        assert status == "miss" and answer
    unavailable = GATEWAY_CACHE.labels("unavailable")._value.get()
    await cache.stop()  # the cache service gone too: the lookup times out, still served
    status, answer = await ask(client, text)
    assert status == "miss" and answer
    assert GATEWAY_CACHE.labels("unavailable")._value.get() > unavailable
