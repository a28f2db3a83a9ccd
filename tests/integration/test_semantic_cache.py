"""The semantic response cache over real NATS and Redis: a cache service, two fleet
gateways sharing it, the official `openai` client. Exact and paraphrased questions hit;
hard negatives and other fingerprints never do; the request header is honoured; a
streamed hit is valid SSE; a restarted replica rebuilds its index."""

from __future__ import annotations

import asyncio
import dataclasses

import openai
import pytest
import pytest_asyncio

from cache_svc.config import SemanticCacheConfig
from cache_svc.service import CacheService
from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from tests.integration.stack import (
    service_config,
    start_disaggregated,
    start_gateway,
    wait_live,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# Generous lookup limits: under a loaded CI machine a 30 ms exact tier would time out and
# turn an exact hit into a semantic one.
ON = SemanticCacheConfig(cache_lookup_timeout_ms=2000, cache_exact_timeout_ms=2000)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory, nats_server, redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    engine = EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=256
    )
    cache = CacheService(service_config(nats_server.url, redis_server.url, "cache-a"), ON)
    await cache.start()
    # lenient heartbeats: no worker dies here, and on a loaded machine a beat of the
    # services sharing this loop can come more than the strict 1 s TTL late
    stack = await start_disaggregated(
        engine, nats_server.url, redis_server.url, "sc", num_decode=1, cache=ON, lenient=True
    )
    other_cfg = dataclasses.replace(
        service_config(nats_server.url, redis_server.url, "gateway-sc2"),
        heartbeat_s=1.0,
        instance_ttl_s=3.0,
    )
    other = await start_gateway(engine, other_cfg, aggregated=False, cache=ON)
    await wait_live(other, num_decode=1)  # its registry learns the workers from heartbeats
    yield stack, other, cache
    await other.stop()
    await stack.stop()
    await cache.stop()


async def settled(fleet) -> None:
    """Every answer the gateways are storing is stored (stores run after the answer)."""
    stack, other, _ = fleet
    for gw in (stack.gateway, other):
        await asyncio.gather(*list(gw.core.cache._tasks))


def client_of(gateway, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none", max_retries=0, **kw
    )


async def ask(client, text: str, system: str | None = None, **kw):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    raw = await client.chat.completions.with_raw_response.create(
        model="demo", messages=messages, **kw
    )
    return raw.headers.get("x-epd-cache"), raw.parse()


async def test_exact_and_paraphrase_hits_are_shared_by_gateways(fleet):
    stack, other, _ = fleet
    a, b = client_of(stack.gateway), client_of(other)
    status, first = await ask(a, "What is the capital of France?")
    assert status == "miss"
    await settled(fleet)  # the store runs after the answer is sent
    status, again = await ask(b, "What is the capital of France?")
    assert status == "hit-exact"
    assert again.choices[0].message.content == first.choices[0].message.content
    raw = await b.chat.completions.with_raw_response.create(
        model="demo",
        messages=[{"role": "user", "content": "What's France's capital city?"}],
        temperature=0,
        max_tokens=8,
    )
    assert raw.headers["x-epd-cache"] == "hit-semantic"
    assert 0.8 <= float(raw.headers["x-epd-cache-similarity"]) < 1.0
    assert raw.parse().choices[0].message.content == first.choices[0].message.content


async def test_an_exact_hit_never_reaches_the_workers(fleet):
    stack, _, _ = fleet
    core = stack.gateway.core
    generate, started = core.backend.generate, []

    def counting(prep):  # the real backend, counted
        started.append(prep.request_id)
        return generate(prep)

    core.backend.generate = counting
    try:
        a = client_of(stack.gateway)
        assert (await ask(a, "Name a large mammal of the Arctic."))[0] == "miss"
        await settled(fleet)
        assert (await ask(a, "Name a large mammal of the Arctic."))[0] == "hit-exact"
        assert len(started) == 1
        assert (await ask(a, "Which big mammal lives in the Arctic?"))[0] == "hit-semantic"
        assert len(started) == 2  # a semantic lookup races the workers
    finally:
        core.backend.generate = generate


@pytest.mark.parametrize(
    "stored,asked",
    [
        ("How many calories are in 3 eggs?", "How many calories are in 4 eggs?"),
        ("Is raw chicken safe to eat?", "Is raw chicken not safe to eat?"),
        ("What is the capital of North Carolina?", "What is the capital of South Carolina?"),
        ("How do I convert USD to EUR?", "How do I convert EUR to USD?"),
        ("How many grams are in a pound?", "How many grams are in a kilogram?"),
        ("What are the pros of electric cars?", "What are the cons of electric cars?"),
    ],
    ids=["number", "negation", "entity", "order", "unit", "opposite"],
)
async def test_hard_negatives_never_hit(fleet, stored, asked):
    stack, _, _ = fleet
    a = client_of(stack.gateway)
    await ask(a, stored)
    await settled(fleet)
    assert (await ask(a, stored))[0] == "hit-exact"  # it was stored
    assert (await ask(a, asked))[0] == "miss"


async def test_other_fingerprints_never_hit(fleet, tmp_path):
    stack, _, _ = fleet
    a = client_of(stack.gateway)
    q = "Which ocean is the largest on Earth?"
    await ask(a, q)
    await settled(fleet)
    assert (await ask(a, q))[0] == "hit-exact"
    assert (await ask(a, q, system="Answer in French."))[0] == "miss"
    assert (await ask(a, q, extra_body={"top_k": 5}))[0] == "miss"
    assert (await ask(a, q, user="someone-else"))[0] == "miss"
    assert (await ask(a, q, stop=["zzz"]))[0] == "miss"
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": q},
    ]
    raw = await a.chat.completions.with_raw_response.create(
        model="demo", messages=history, temperature=0, max_tokens=8
    )
    assert raw.headers["x-epd-cache"] == "miss"
    sampled = await a.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": q}], temperature=0.7, max_tokens=8
    )
    assert sampled.headers["x-epd-cache"] == "miss"  # sampled requests are not cached


async def test_max_tokens_rules(fleet):
    stack, _, _ = fleet
    a = client_of(stack.gateway)
    q = "Tell me about the history of the violin."
    status, cut = await ask(a, q, max_tokens=4, extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "length"
    await settled(fleet)
    assert (await ask(a, q, max_tokens=4, extra_body={"ignore_eos": True}))[0] == "hit-exact"
    # An answer cut at 4 tokens serves only max_tokens=4.
    assert (await ask(a, q, max_tokens=6, extra_body={"ignore_eos": True}))[0] == "miss"


async def test_n_is_part_of_the_key(fleet):
    stack, _, _ = fleet
    a = client_of(stack.gateway)
    q = "Which planet has the most moons?"
    assert (await ask(a, q))[0] == "miss"
    await settled(fleet)
    status, two = await ask(a, q, n=2)
    assert status == "miss" and len(two.choices) == 2
    await settled(fleet)
    status, again = await ask(a, q, n=2)
    assert status == "hit-exact"
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]


async def test_request_header_modes(fleet):
    stack, _, _ = fleet
    q = "How do I fold a fitted sheet neatly?"
    store_only = client_of(stack.gateway, default_headers={"x-epd-cache": "no-cache"})
    bypass = client_of(stack.gateway, default_headers={"x-epd-cache": "bypass"})
    no_store = client_of(stack.gateway, default_headers={"x-epd-cache": "no-store"})
    plain = client_of(stack.gateway)
    assert (await ask(no_store, q))[0] == "miss"
    await settled(fleet)
    assert (await ask(plain, q))[0] == "miss"  # no-store stored nothing (this one stores)
    await settled(fleet)
    assert (await ask(bypass, q))[0] == "miss"
    assert (await ask(store_only, q))[0] == "miss"  # no-cache never reads
    assert (await ask(plain, q))[0] == "hit-exact"
    with pytest.raises(openai.BadRequestError):
        await ask(client_of(stack.gateway, default_headers={"x-epd-cache": "sometimes"}), q)


async def test_a_streamed_hit_is_well_formed_sse(fleet):
    stack, _, _ = fleet
    a = client_of(stack.gateway)
    q = "Why is the sky blue during the day?"
    _, full = await ask(a, q, max_tokens=24)
    await settled(fleet)
    raw = await a.chat.completions.with_raw_response.create(
        model="demo",
        messages=[{"role": "user", "content": q}],
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-epd-cache"] == "hit-exact"
    chunks = [c async for c in raw.parse()]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        full.choices[0].message.content
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


async def test_grpc_gets_the_cache_too(fleet):
    stack, _, _ = fleet
    msg = pb.ChatMessage(role="user", content="What is the boiling point of water at sea level?")
    req = pb.GenerateRequest(
        model="demo",
        chat=pb.Chat(messages=[msg]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=6),
    )
    call = stack.stub.GenerateOnce(req)
    assert dict(await call.initial_metadata())["x-epd-cache"] == "miss"
    first = await call
    await settled(fleet)
    call = stack.stub.GenerateOnce(req)
    assert dict(await call.initial_metadata())["x-epd-cache"] == "hit-exact"
    assert (await call).token_ids == first.token_ids
    req.cache_opt_out = True
    call = stack.stub.GenerateOnce(req)
    assert dict(await call.initial_metadata())["x-epd-cache"] == "miss"
    assert (await call).token_ids == first.token_ids
    call = stack.stub.Generate(req, metadata=(("x-epd-cache", "bypass"),))
    assert [r async for r in call] and dict(await call.initial_metadata())["x-epd-cache"] == "miss"


async def test_a_restarted_replica_rebuilds_its_index(fleet, nats_server, redis_server):
    stack, _, cache = fleet
    a = client_of(stack.gateway)
    await ask(a, "How long should I rest a steak after cooking it?")
    await settled(fleet)
    await cache.stop()
    fresh = CacheService(service_config(nats_server.url, redis_server.url, "cache-b"), ON)
    await fresh.start()
    try:
        assert len(fresh.cache.index) >= 1
        status, _ = await ask(a, "After cooking a steak, how long should it rest?")
        assert status == "hit-semantic"
    finally:
        await fresh.stop()
