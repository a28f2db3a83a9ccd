"""The semantic cache on a fleet of two models (Llama, Qwen2) behind one gateway, real
NATS and Redis and a real cache service: an answer is stored under the model that gave
it, so the same question to the other model is a miss answered by that model's own
instances, and a repeat to the first model is a hit with its stored answer."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import pytest_asyncio

from cache_svc.service import CacheService
from decode_svc.service import DecodeService
from gateway.app import Gateway
from gateway.config import GatewayConfig
from prefill_svc.service import PrefillService
from services.config import EngineConfig, ServiceConfig
from tests.helpers.checkpoints import make_text_checkpoint
from tests.integration.stack import service_config
from tests.integration.test_semantic_cache import ON  # generous lookup limits

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory, nats_server, redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    root = tmp_path_factory.mktemp("ckpt")
    paths = [str(make_text_checkpoint(root, kind)) for kind in ("llama", "qwen2")]

    def cfg(name: str) -> ServiceConfig:  # every service here shares the test's loop
        c = service_config(nats_server.url, redis_server.url, f"mmc-{name}")
        return dataclasses.replace(c, heartbeat_s=1.0, instance_ttl_s=3.0)

    services = [CacheService(cfg("cache"), ON)]
    for i, path in enumerate(paths):
        engine = EngineConfig(model=path, num_kv_blocks=128)
        services += [
            PrefillService(engine, cfg(f"prefill{i}")),
            DecodeService(engine, cfg(f"decode{i}")),
        ]
    gateway = Gateway(
        EngineConfig(model=paths[0]),
        cfg("gateway"),
        aggregated=False,
        api=GatewayConfig(http_port=0),
        cache=ON,
        models=paths,
    )
    try:
        for svc in services:
            await svc.start()
        await gateway.start()
        await gateway.link.registry.wait_for(
            lambda: all(core.backend.ready() for core in gateway.models), timeout_s=120
        )
        yield gateway, services
    finally:
        await gateway.stop()
        for svc in services:
            await svc.stop()


async def _ask(gateway: Gateway, model: str, text: str) -> tuple[str, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
    }
    base = f"http://127.0.0.1:{gateway.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-epd-cache"], r.json()["choices"][0]["message"]["content"]


async def _settled(gateway: Gateway) -> None:
    """Every answer the gateway is storing is stored (stores run after the answer)."""
    for core in gateway.models:
        await asyncio.gather(*list(core.cache._tasks))


async def test_answers_are_cached_per_answering_model(fleet):
    gateway, services = fleet
    llama, qwen = gateway.models.names
    decodes = {llama: services[2], qwen: services[4]}
    question = "What is the capital of France?"
    status, llama_answer = await _ask(gateway, llama, question)
    assert status == "miss"
    await _settled(gateway)
    before = decodes[qwen].adopted
    status, qwen_answer = await _ask(gateway, qwen, question)
    assert status == "miss"  # Llama's stored answer is not Qwen2's
    assert decodes[qwen].adopted == before + 1  # Qwen2's own instance answered
    assert qwen_answer != llama_answer
    await _settled(gateway)
    for model, answer in ((llama, llama_answer), (qwen, qwen_answer)):
        adopted = decodes[model].adopted
        assert await _ask(gateway, model, question) == ("hit-exact", answer)
        assert decodes[model].adopted == adopted  # from the cache: no worker ran
