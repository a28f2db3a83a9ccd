"""A stopping gateway lets its open streams finish (within the grace) before it closes
the engine, and takes no new calls."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from tests.integration.stack import Stack, service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

MAX_TOKENS = 600


def _request() -> pb.GenerateRequest:
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text="a long story, please")])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def test_open_stream_finishes_while_the_gateway_stops(tmp_path, nats_server, redis_server):
    engine = EngineConfig(model="demo", demo_dir=str(tmp_path / "demo"), num_kv_blocks=128)
    cfg = service_config(nats_server.url, redis_server.url, "all-drain")
    gw = await start_gateway(
        engine, dataclasses.replace(cfg, shutdown_grace_s=60.0), aggregated=True
    )
    stack = Stack(gw, channel=grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}"))
    stopping = None
    try:
        got, at_stop = 0, None
        async for resp in stack.stub.Generate(_request(), timeout=120):
            got += len(resp.token_ids)
            if stopping is None and got >= 2:
                at_stop, stopping = got, asyncio.create_task(stack.gateway.stop())
        assert got == MAX_TOKENS and at_stop < MAX_TOKENS  # it was mid-way, and finished
        await asyncio.wait_for(stopping, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.stub.GenerateOnce(_request(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stack.stop()
