"""``epd serve <role>``: one service in this process until SIGINT / SIGTERM."""

from __future__ import annotations

from services.config import EngineConfig, ServiceConfig
from services.observability import ObservabilityConfig
from services.runtime import run, serve_until_signal


def make_service(
    role: str, engine_config: EngineConfig, config: ServiceConfig, gateway=None, cache=None
):
    if role == "encoder":
        from encoder_svc.service import EncoderService

        return EncoderService(engine_config, config)
    if role == "prefill":
        from prefill_svc.service import PrefillService

        return PrefillService(engine_config, config)
    if role == "decode":
        from decode_svc.service import DecodeService

        return DecodeService(engine_config, config)
    if role == "cache":
        from cache_svc.service import CacheService

        return CacheService(config, cache)
    if role in ("gateway", "all"):
        from gateway.app import Gateway

        return Gateway(engine_config, config, aggregated=role == "all", api=gateway, cache=cache)
    raise ValueError(f"unknown role {role!r}")


def serve(
    role: str,
    engine_config: EngineConfig,
    config: ServiceConfig,
    gateway=None,
    cache=None,
    observability: ObservabilityConfig | None = None,
) -> int:
    """``gateway``: the GatewayConfig of the gateway roles (gateway, all); ``cache``: the
    SemanticCacheConfig of the cache service and the gateways; ``observability``: logs
    and the metrics port."""
    service = make_service(role, engine_config, config, gateway, cache)
    if observability is not None:
        service.observability = observability
    run(serve_until_signal(service), config.event_loop)
    return 0
