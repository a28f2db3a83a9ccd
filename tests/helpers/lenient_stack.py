"""tests/integration/stack.py's in-process fleet with the services' default heartbeat
(1 s) and instance TTL (3 s) instead of that file's 0.2 s / 1 s.

Every service of such a fleet shares the test's one event loop. Under heavy load (many
streams, or a busy shared box) a beat can come more than 1 s late, which the gateway
reads as a dead worker: its requests then move or fail, which a test about something
else must not see.
"""

from __future__ import annotations

import asyncio

import grpc

from decode_svc.service import DecodeService
from encoder_svc.service import EncoderService
from prefill_svc.service import PrefillService
from services.config import EngineConfig, ServiceConfig
from tests.integration.stack import Stack, service_config, start_gateway


def lenient_config(nats_url: str, redis_url: str, name: str) -> ServiceConfig:
    cfg = service_config(nats_url, redis_url, name)
    cfg.heartbeat_s, cfg.instance_ttl_s = 1.0, 3.0
    return cfg


async def start_lenient(engine: EngineConfig, nats_url: str, redis_url: str, tag: str,
                        num_decode: int = 2) -> Stack:  # fmt: skip
    """Encoder, prefill, ``num_decode`` decodes and a gateway that sees them all."""

    def cfg(name: str) -> ServiceConfig:
        return lenient_config(nats_url, redis_url, f"{name}-{tag}")

    stack = Stack(None, EncoderService(engine, cfg("encoder")),
                  PrefillService(engine, cfg("prefill")),
                  [DecodeService(engine, cfg(f"decode{i}")) for i in range(num_decode)])  # fmt: skip
    try:
        await asyncio.gather(*(s.start() for s in (stack.encoder, stack.prefill, *stack.decodes)))
        stack.gateway = await start_gateway(engine, cfg("gateway"), aggregated=False)
        router = stack.gateway.core.backend.router
        await stack.gateway.core.backend.registry.wait_for(
            lambda: (
                bool(router.live("encode") and router.live("prefill"))
                and len(router.live("decode")) == num_decode
            ),
            timeout_s=30,
        )
    except BaseException:
        await stack.stop()
        raise
    stack.channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.grpc_port}")
    return stack
