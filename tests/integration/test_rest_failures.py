"""REST statuses that need a particular server state: 503 with no worker up, 429 when the
gateway is at capacity, 504 on the deadline (also in `serve all`); each time the next
request is served normally."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import pytest_asyncio

from gateway.config import GatewayConfig
from services.config import EngineConfig
from tests.helpers.checkpoints import make_text_checkpoint
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> EngineConfig:
    return EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=256
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lonely_gateway(tmp_path_factory, nats_server, redis_server):
    """A fleet gateway for a model no worker serves."""
    ckpt = make_text_checkpoint(tmp_path_factory.mktemp("lonely"), "llama")
    cfg = service_config(nats_server.url, redis_server.url, "gateway-lonely")
    gw = await start_gateway(EngineConfig(model=str(ckpt)), cfg, aggregated=False)
    yield gw
    await gw.stop()


async def test_no_worker_is_503_and_health_says_so(lonely_gateway):
    base = f"http://127.0.0.1:{lonely_gateway.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        assert (await http.get("/health")).status_code == 503
        body = dict(CHAT, model=lonely_gateway.core.info.model_id)
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 503 and resp.headers["retry-after"]
        assert "no live" in resp.json()["error"]["message"]
        stream = await http.post("/v1/chat/completions", json=dict(body, stream=True))
        assert stream.status_code == 503  # a stream fails before its first byte: a real status


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small_gateway(demo, nats_server, redis_server):
    """`serve all` that takes one request at a time and gives each 1.5 s."""
    cfg = service_config(nats_server.url, redis_server.url, "all-small")
    cfg.request_timeout_s = 1.5
    gw = await start_gateway(
        demo, cfg, aggregated=True, api=GatewayConfig(http_port=0, max_inflight=1)
    )
    yield gw
    await gw.stop()


async def test_capacity_gives_429_then_serves(small_gateway):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{small_gateway.http_port}/v1", api_key="none", max_retries=0
    )
    long = await client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "go on"}],
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = await anext(aiter(long))
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(**CHAT)
    assert err.value.response.headers["retry-after"]
    await long.close()
    for _ in range(50):  # the closed stream leaves the gateway within a moment
        if small_gateway.core.inflight == 0:
            break
        await asyncio.sleep(0.02)
    out = await client.chat.completions.create(**CHAT)
    assert out.choices[0].message.content


async def test_deadline_gives_504_in_serve_all_then_serves(small_gateway):
    base = f"http://127.0.0.1:{small_gateway.http_port}"
    body = dict(CHAT, max_tokens=2000, ignore_eos=True)
    body["messages"] = [{"role": "user", "content": "x"}]
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "timeout"
        engine = small_gateway.core.backend.engine.engine
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_unfinished_requests()  # the timed-out request was aborted
        ok = await http.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
