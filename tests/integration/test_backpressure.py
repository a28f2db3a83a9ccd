"""Backpressure at the gateway, over real NATS and Redis.

A gateway with ``max_inflight_per_instance=2`` over one prefill and one decode instance:
while two requests hold the decode, every further one is refused at once with
RESOURCE_EXHAUSTED over gRPC and 429 + Retry-After over REST (plain and streamed), the
refusals leak no in-flight count, and as soon as the holders are gone new requests are
served again. A request with 10,000 stop strings is refused as the client's fault:
INVALID_ARGUMENT over gRPC, 400 over REST.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from decode_svc.service import DecodeService
from gateway.config import GatewayConfig
from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from tests.helpers.checkpoints import make_text_checkpoint
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LIMIT = 2
WAIT_S = 60.0


class Fleet:
    def __init__(self, gw, prefill, decode, channel):
        self.gw, self.prefill, self.decode, self.channel = gw, prefill, decode, channel
        self.stub = pbg.InferenceStub(channel)
        self.router = gw.core.backend.router
        self.base = f"http://127.0.0.1:{gw.http_port}"
        self.model = gw.core.info.model_id

    def inflight(self) -> tuple[int, int, int]:
        """(gateway, prefill, decode) requests in flight as the gateway counts them."""
        r = self.router
        return (
            self.gw.core.inflight,
            r.inflight("prefill", self.prefill.instance_id),
            r.inflight("decode", self.decode.instance_id),
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory, nats_server, redis_server):
    # A long context: the holders below must outlast every refusal the tests make.
    ckpt = make_text_checkpoint(
        tmp_path_factory.mktemp("ckpt"), "llama", max_position_embeddings=8192
    )
    engine = EngineConfig(model=str(ckpt), num_kv_blocks=1024)

    def cfg(name: str):
        return service_config(nats_server.url, redis_server.url, f"{name}-bp")

    prefill, decode = PrefillService(engine, cfg("prefill")), DecodeService(engine, cfg("decode"))
    await asyncio.gather(prefill.start(), decode.start())
    gw = await start_gateway(
        engine,
        cfg("gateway"),
        aggregated=False,
        api=GatewayConfig(http_port=0, max_inflight_per_instance=LIMIT),
    )
    await gw.core.backend.registry.wait_for(gw.core.backend.ready, timeout_s=30)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
    yield Fleet(gw, prefill, decode, channel)
    await channel.close()
    await gw.stop()
    await asyncio.gather(prefill.stop(), decode.stop())


def request(i: int, max_tokens: int = 8, stop=()) -> pb.GenerateRequest:
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=f"request {i}, go on")])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


def chat_body(fleet: Fleet, i: int, **extra) -> dict:
    return {
        "model": fleet.model,
        "messages": [{"role": "user", "content": f"rest {i}"}],
        "max_tokens": 8,
        **extra,
    }


async def grpc_outcome(stub, req) -> str | int:
    """The status name a call ended with, or its number of tokens when it succeeded."""
    try:
        tokens = 0
        async for resp in stub.Generate(req, timeout=WAIT_S):
            tokens += len(resp.token_ids)
        return tokens
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def settled(fleet: Fleet) -> None:
    """Every request has left the gateway's books (bounded wait)."""
    async with asyncio.timeout(10):
        while fleet.inflight() != (0, 0, 0):
            await asyncio.sleep(0.01)


async def hold_the_decode(fleet: Fleet) -> list[asyncio.Task]:
    """LIMIT long streams, each past its first token (so each holds a decode lease)."""
    started = [asyncio.Event() for _ in range(LIMIT)]

    async def hold(i: int) -> None:
        async for _ in fleet.stub.Generate(request(1000 + i, max_tokens=4000), timeout=WAIT_S):
            started[i].set()

    tasks = [asyncio.create_task(hold(i)) for i in range(LIMIT)]
    async with asyncio.timeout(WAIT_S):
        await asyncio.gather(*(e.wait() for e in started))
    assert fleet.inflight()[2] == LIMIT
    return tasks


async def release(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_full_decode_refuses_over_grpc_and_rest_then_recovers(fleet):
    await settled(fleet)
    holders = await hold_the_decode(fleet)
    try:
        burst = await asyncio.gather(*(grpc_outcome(fleet.stub, request(i)) for i in range(6)))
        assert burst == ["RESOURCE_EXHAUSTED"] * 6
        async with httpx.AsyncClient(base_url=fleet.base, timeout=WAIT_S) as http:
            posts = [http.post("/v1/chat/completions", json=chat_body(fleet, i)) for i in range(4)]
            posts += [
                http.post("/v1/chat/completions", json=chat_body(fleet, i, stream=True))
                for i in range(4, 6)
            ]
            answers = await asyncio.gather(*posts)
        for resp in answers:
            assert resp.status_code == 429, resp.text
            assert int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["type"] == "rate_limit_error"
        client = openai.AsyncOpenAI(base_url=f"{fleet.base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(**chat_body(fleet, 99))
        assert err.value.response.headers["retry-after"]
        # The refusals took nothing: only the two holders are counted.
        assert fleet.inflight() == (LIMIT, 0, LIMIT)
    finally:
        await release(holders)
    await settled(fleet)
    assert await asyncio.gather(*(grpc_outcome(fleet.stub, request(i)) for i in range(2))) == [8, 8]
    out = await client.chat.completions.create(**chat_body(fleet, 100))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8


async def test_a_burst_beyond_the_limit_is_partly_refused_and_the_rest_served(fleet):
    """No holders: 10 long requests at once. Each either completes in full or is refused
    with RESOURCE_EXHAUSTED; never more than LIMIT run on the decode at once."""
    await settled(fleet)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, fleet.inflight()[2])
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(WAIT_S):
            outcomes = await asyncio.gather(
                *(grpc_outcome(fleet.stub, request(200 + i, max_tokens=300)) for i in range(10))
            )
    finally:
        watcher.cancel()
    assert set(outcomes) <= {300, "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes.count(300) >= LIMIT and outcomes.count("RESOURCE_EXHAUSTED") >= 1, outcomes
    assert peak == LIMIT
    await settled(fleet)
    assert await grpc_outcome(fleet.stub, request(300)) == 8


async def test_ten_thousand_stop_strings_are_invalid_argument_and_400(fleet):
    stops = [f"stop{i}" for i in range(10_000)]
    assert await grpc_outcome(fleet.stub, request(1, stop=stops)) == "INVALID_ARGUMENT"
    async with httpx.AsyncClient(base_url=fleet.base, timeout=WAIT_S) as http:
        for stream in (False, True):
            resp = await http.post(
                "/v1/chat/completions", json=chat_body(fleet, 1, stop=stops, stream=stream)
            )
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "stop"
        resp = await http.post(
            "/v1/completions",
            json={"model": fleet.model, "prompt": "hi", "max_tokens": 4, "stop": stops},
        )
        assert resp.status_code == 400, resp.text
    await settled(fleet)
    assert await grpc_outcome(fleet.stub, request(2, stop=["never-said"])) == 8
