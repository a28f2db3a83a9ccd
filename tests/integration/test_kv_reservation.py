"""A decode instance without room for a request's KV refuses it before the transfer, and
the gateway moves the request to one that has room: every request completes, and the
refusing instance holds no block afterwards (token identity across a move:
tests/unit/test_migration_engine.py, tests/integration/test_fleet_migration.py)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from decode_svc.service import DecodeService
from gateway.config import GatewayConfig
from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from services.metrics import MIGRATIONS
from tests.helpers.checkpoints import make_text_checkpoint
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


def _request(i: int) -> pb.GenerateRequest:
    text = " ".join(f"word{i}x{j}" for j in range(60))  # ~120 tokens: 8 blocks of 16
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=text)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def test_a_full_decode_refuses_and_the_request_moves(tmp_path, nats_server, redis_server):
    ckpt = make_text_checkpoint(tmp_path, "llama")
    roomy = EngineConfig(model=str(ckpt), num_kv_blocks=256)
    tight = dataclasses.replace(roomy, num_kv_blocks=6)  # < the prompt's blocks
    cfg = lambda name: service_config(nats_server.url, redis_server.url, name)  # noqa: E731
    services = [
        PrefillService(roomy, cfg("p-kv")),
        DecodeService(tight, cfg("d-tight")),
        DecodeService(roomy, cfg("d-roomy")),
    ]
    gw = channel = None
    try:
        for s in services:
            await s.start()
        gw = await start_gateway(
            roomy,
            cfg("gw-kv"),
            aggregated=False,
            api=GatewayConfig(http_port=0, router_policy="round_robin"),
        )
        await gw.core.backend.registry.wait_for(
            lambda: len(gw.core.backend.router.live("decode")) == 2, timeout_s=10
        )
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        stub = pbg.InferenceStub(channel)
        before = MIGRATIONS.labels("decode", "migration")._value.get()
        outs = [
            list((await stub.GenerateOnce(_request(i), timeout=60)).token_ids) for i in range(4)
        ]
        assert all(len(o) == 12 for o in outs)
        # Round robin sent some to the tight one; each was refused and moved once.
        assert MIGRATIONS.labels("decode", "migration")._value.get() - before >= 1
        tight_llm = services[1].engine.engine
        assert services[1].adopted == 0
        assert tight_llm.block_manager.num_free_blocks == 6  # reservations never leaked
        assert not tight_llm.imports.reserved
    finally:
        if channel is not None:
            await channel.close()
        if gw is not None:
            await gw.stop()
        for s in services:
            await s.stop()
