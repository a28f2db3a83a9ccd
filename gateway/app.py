"""The gateway service: gRPC (and OpenAI REST) in front of the aggregated engine or the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from cache_svc.config import SemanticCacheConfig
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.grpc_server import start_grpc_server, track_health
from gateway.prepare import RequestPreparer
from gateway.response_cache import BusCacheClient, LocalCacheClient, ResponseCache
from gateway.rest.server import RestServer
from services.config import EngineConfig, ServiceConfig
from services.models.info import ModelInfo
from services.tokenization import load_tokenizer

log = logging.getLogger(__name__)


class Gateway:
    """``aggregated`` runs the engine here (``epd serve all``); otherwise requests go
    E -> P -> D over NATS."""

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig, aggregated: bool,
                 api: GatewayConfig | None = None,
                 cache: SemanticCacheConfig | None = None):  # fmt: skip
        self.engine_config = engine_config
        self.config = config
        self.api = api or GatewayConfig()
        self.cache_config = cache or SemanticCacheConfig()
        self._local_cache = None  # serve all: the semantic cache in this process
        self.aggregated = aggregated
        self.instance_id = config.instance_id or f"gateway-{uuid.uuid4().hex[:8]}"
        self.core: GatewayCore | None = None
        self.grpc_server = self.rest = None
        self.grpc_port = self.http_port = 0
        self._stopped = False
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        info = ModelInfo.load(self.engine_config)
        tokenizer = load_tokenizer(info.model_dir, torch_free=True)
        backend = await self._backend()
        await backend.start()
        preparer = RequestPreparer(info, tokenizer, self.config.request_timeout_s, self.api)
        self.core = GatewayCore(preparer, backend, self.api, await self._cache(backend, info))
        self.grpc_server, self.grpc_port, health = await start_grpc_server(
            self.core, self.config.host, self.config.grpc_port
        )
        self._health_task = asyncio.create_task(
            track_health(health, self.core, self.config.heartbeat_s / 2)
        )
        self.rest = RestServer(self.core, self.config.host, self.api.http_port)
        await self.rest.start()
        self.http_port = self.rest.port
        log.info("gateway %s serving gRPC on port %d, REST on port %d", self.instance_id,
                 self.grpc_port, self.http_port)  # fmt: skip

    async def _cache(self, backend, info: ModelInfo) -> ResponseCache | None:
        """The response cache: the cache service over the bus (fleet), or one in this
        process (serve all: it runs the engine, so the embedding model may live here)."""
        if not self.cache_config.cache_enabled:
            return None
        if self.aggregated:
            from cache_svc.service import open_cache

            self._local_cache = await open_cache(self.config.redis_url, self.cache_config)
            client = LocalCacheClient(self._local_cache)
        else:
            client = BusCacheClient(backend.bus)
        return ResponseCache(client, self.cache_config, info.fingerprint)

    async def _backend(self):
        if self.aggregated:
            from gateway.aggregated import AggregatedBackend
            from services.engine.async_engine import AsyncEngine
            from services.engine.llm_engine import LLMEngine

            return AggregatedBackend(AsyncEngine(LLMEngine(self.engine_config)))
        from gateway.disaggregated import DisaggregatedBackend

        return DisaggregatedBackend(self.engine_config, self.config, self.instance_id)

    async def stop(self) -> None:
        """Stop taking requests, let in-flight ones finish (grace), then close; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.rest is not None:
            await self.rest.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.config.shutdown_grace_s)
        if self.core is not None:
            await self.core.backend.stop()
        if self._local_cache is not None:
            await self._local_cache.stop()
