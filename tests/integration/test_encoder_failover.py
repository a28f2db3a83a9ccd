"""An encoder killed while it holds an image: the image is encoded on another encoder and
the request completes with the tokens of an undisturbed run. Encoders, prefill and decode
run as `epd serve` processes (the demo LLaVA, and Qwen2.5-VL whose embedding's length
follows the image); the gateway runs here."""

from __future__ import annotations

import asyncio
import io

import grpc
import pytest

from gateway.config import GatewayConfig
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.bus import subjects
from services.config import EngineConfig
from services.metrics import MIGRATIONS
from services.models.info import ModelInfo
from tests.helpers.checkpoints import make_qwen2_5_vl_checkpoint, random_image
from tests.helpers.fleet import ProcessFleet, fail_message, kill_the_holder
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


def _request(seed: int) -> pb.GenerateRequest:
    buf = io.BytesIO()
    random_image(seed, (64, 64)).save(buf, format="PNG")
    msg = pb.ChatMessage(
        role="user",
        parts=[pb.ContentPart(image=buf.getvalue()), pb.ContentPart(text="what is this?")],
    )
    sp = pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
async def test_an_encoder_killed_mid_encode_is_replaced(
    tmp_path, nats_server, redis_server, family
):
    demo = str(tmp_path / "demo")
    model = "demo" if family == "llava" else str(make_qwen2_5_vl_checkpoint(tmp_path))
    engine = EngineConfig(model=model, demo_dir=demo)
    fleet = ProcessFleet(
        model,
        nats_server.url,
        redis_server.url,
        tmp_path,
        {"EPD_DEMO_DIR": demo, "EPD_NUM_KV_BLOCKS": "256"},
    )
    gw = channel = None
    try:
        await asyncio.to_thread(ModelInfo.load, engine)  # the demo is written before the children
        encoders = [fleet.spawn("encoder", f"e{i}") for i in range(2)]  # the CLI role name
        fleet.spawn(subjects.ROLE_PREFILL, "p0")
        fleet.spawn(subjects.ROLE_DECODE, "d0")
        gw = await start_gateway(
            engine,
            service_config(nats_server.url, redis_server.url, "gw-e"),
            aggregated=False,
            api=GatewayConfig(http_port=0, router_policy="round_robin"),
        )
        backend = gw.core.backend
        try:
            await backend.registry.wait_for(
                lambda: len(backend.router.live("encode")) == 2 and backend.ready(), 180
            )
        except TimeoutError:
            pytest.fail(f"the fleet never came up:\n{fail_message(fleet)}")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        stub = pbg.InferenceStub(channel)
        reference = list((await stub.GenerateOnce(_request(1), timeout=60)).token_ids)
        await _flush_embeddings(redis_server.url)  # the image must be encoded again
        before = MIGRATIONS.labels("encode", "retry")._value.get()
        call = await kill_the_holder(
            encoders, subjects.ROLE_ENCODE, gw, lambda: stub.GenerateOnce(_request(1), timeout=60)
        )
        assert list((await call).token_ids) == reference
        assert MIGRATIONS.labels("encode", "retry")._value.get() - before == 1
    finally:
        if channel is not None:
            await channel.close()
        if gw is not None:
            await gw.stop()
        fleet.stop()


async def _flush_embeddings(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter("epd:emb:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
