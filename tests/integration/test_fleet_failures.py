"""Failures across the fleet: Redis down means cache misses, not failed requests; a decode
instance that dies mid-request hands its stream to the other one, which continues it
with exactly the undisturbed tokens (greedy), never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import io

import grpc
import pytest
import pytest_asyncio

from launch.localstack import free_port
from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from tests.helpers.checkpoints import random_image
from tests.integration.stack import start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory, nats_server):
    engine = EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=128
    )
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    s = await start_disaggregated(engine, nats_server.url, dead_redis, "fail")
    yield s
    await s.stop()


def request(text: str, images=(), max_tokens: int = 8, **kw) -> pb.GenerateRequest:
    parts = [pb.ContentPart(image=im) for im in images] + [pb.ContentPart(text=text)]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", parts=parts)]), sampling=sp
    )


async def test_image_requests_succeed_with_redis_down(stack):
    buf = io.BytesIO()
    random_image(3).save(buf, format="PNG")
    out = await stack.stub.GenerateOnce(request("what is this", [buf.getvalue()]), timeout=60)
    assert len(out.token_ids) == 8


async def test_decode_crash_mid_request_migrates_with_the_undisturbed_tokens(stack):
    req = request("long answer please", max_tokens=300, ignore_eos=True)
    reference = list((await stack.stub.GenerateOnce(req, timeout=60)).token_ids)
    got: list[int] = []
    async with asyncio.timeout(60):
        async for resp in stack.stub.Generate(req):
            got += resp.token_ids
            if len(got) >= 20 and not any(d.bus.client.is_closed for d in stack.decodes):
                await _crash(next(d for d in stack.decodes if d.routes))
    assert got == reference
    survivor = next(d for d in stack.decodes if not d.bus.client.is_closed)
    before = survivor.adopted
    out = await stack.stub.GenerateOnce(request("still there?"), timeout=60)
    assert len(out.token_ids) == 8 and survivor.adopted == before + 1


async def _crash(decode) -> None:
    """Vanish without a word: no draining heartbeat, no error message, connection gone."""
    decode.heartbeat._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await decode.heartbeat._task
    await decode.bus.client.close()
    decode.routes.clear()


async def test_a_client_deadline_binds_every_hop(stack):
    """The gRPC deadline becomes the request's: the client gets DEADLINE_EXCEEDED and the
    decode instance stops spending steps on it (no orphan generating to max_tokens)."""
    req = request("long answer please", max_tokens=1900, ignore_eos=True)
    got = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for resp in stack.stub.Generate(req, timeout=0.6):
            got += len(resp.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and got < 1900
    live = [d for d in stack.decodes if not d.bus.client.is_closed]
    await stack.gateway.core.backend.registry.wait_for(
        lambda: all(d.engine.load()["running"] == 0 for d in live), timeout_s=5
    )
