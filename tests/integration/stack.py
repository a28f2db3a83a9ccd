"""The whole fleet in one process: encoder, prefill, N decode and a gateway, each with its
own engine thread, bus connection and heartbeats, against private NATS and Redis."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import grpc

from cache_svc.config import SemanticCacheConfig
from decode_svc.service import DecodeService
from encoder_svc.service import EncoderService
from gateway.app import Gateway
from gateway.config import GatewayConfig
from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig, ServiceConfig
from services.models.info import ModelInfo


@dataclass
class Stack:
    gateway: Gateway | None
    encoder: EncoderService | None = None
    prefill: PrefillService | None = None
    decodes: list[DecodeService] = field(default_factory=list)
    channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> pbg.InferenceStub:
        return pbg.InferenceStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.gateway is not None:
            await self.gateway.stop()
        for svc in (self.prefill, *self.decodes, self.encoder):
            if svc is not None:
                await svc.stop()


def service_config(nats_url: str, redis_url: str, name: str) -> ServiceConfig:
    return ServiceConfig(
        nats_url=nats_url,
        redis_url=redis_url,
        instance_id=name,
        grpc_port=0,
        heartbeat_s=0.2,
        instance_ttl_s=1.0,
        bus_timeout_s=10.0,
        stall_timeout_s=10.0,
        request_timeout_s=60.0,
        shutdown_grace_s=2.0,
    )


# The fleet tests compare engine paths: a response-cache hit would make them vacuous, so
# the cache is off unless a test turns it on (tests/integration/test_semantic_cache.py).
NO_CACHE = SemanticCacheConfig(cache_enabled=False)


async def start_gateway(
    engine: EngineConfig,
    cfg: ServiceConfig,
    aggregated: bool,
    api: GatewayConfig | None = None,
    cache: SemanticCacheConfig = NO_CACHE,
) -> Gateway:
    gw = Gateway(
        engine, cfg, aggregated=aggregated, api=api or GatewayConfig(http_port=0), cache=cache
    )
    await gw.start()
    return gw


async def start_disaggregated(
    engine: EngineConfig,
    nats_url: str,
    redis_url: str,
    tag: str,
    num_decode: int = 2,
    cache: SemanticCacheConfig = NO_CACHE,
    lenient: bool = False,
) -> Stack:
    """``lenient``: the services' default heartbeat (1 s) and instance TTL (3 s) instead
    of 0.2 s / 1 s. Every service here shares the test's one event loop: under heavy
    load (hundreds of streams, a busy shared box) a beat can come more than 1 s late,
    which the gateway reads as a dead worker, moving streams a test compares."""

    def cfg(name: str) -> ServiceConfig:
        c = service_config(nats_url, redis_url, f"{name}-{tag}")
        return dataclasses.replace(c, heartbeat_s=1.0, instance_ttl_s=3.0) if lenient else c

    vision = ModelInfo.load(engine).vision  # a text model gets no encoder
    encoder = EncoderService(engine, cfg("encoder")) if vision else None
    prefill = PrefillService(engine, cfg("prefill"))
    decodes = [DecodeService(engine, cfg(f"decode{i}")) for i in range(num_decode)]
    stack = Stack(None, encoder, prefill, decodes)
    try:
        services = [s for s in (encoder, prefill, *decodes) if s is not None]
        await asyncio.gather(*(s.start() for s in services))
        stack.gateway = gw = await start_gateway(
            engine, cfg("gateway"), aggregated=False, cache=cache
        )
        await wait_live(gw, num_decode, vision)
    except BaseException:
        await stack.stop()
        raise
    stack.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
    return stack


async def start_fleet_and_serve_all(
    engine: EngineConfig, nats_url: str, redis_url: str, tag: str
) -> tuple[Stack, Stack]:
    """The model as a fleet (one decode instance) and as `serve all`, on one bus: the
    pair the per-model parity tests compare against transformers."""
    fleet = await start_disaggregated(engine, nats_url, redis_url, tag, 1)
    try:
        return fleet, await start_aggregated(engine, nats_url, redis_url, tag)
    except BaseException:
        await fleet.stop()
        raise


async def wait_live(
    gw: Gateway, num_decode: int, encoder: bool = True, timeout_s: float = 10.0
) -> None:
    """Until ``gw``'s registry sees an encoder (if asked), a prefill and ``num_decode``
    decode instances of its model (heartbeats; other stacks may share the bus)."""
    registry, fp = gw.core.backend.registry, gw.core.info.fingerprint

    def live(role: str) -> int:
        return sum(i.model == fp for i in registry.live(role))

    await registry.wait_for(
        lambda: (
            live("decode") == num_decode and live("prefill") and (live("encode") or not encoder)
        ),
        timeout_s=timeout_s,
    )


async def start_aggregated(
    engine: EngineConfig,
    nats_url: str,
    redis_url: str,
    tag: str,
    cache: SemanticCacheConfig = NO_CACHE,
) -> Stack:
    gw = await start_gateway(
        engine, service_config(nats_url, redis_url, f"all-{tag}"), aggregated=True, cache=cache
    )
    stack = Stack(gw)
    stack.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
    return stack
