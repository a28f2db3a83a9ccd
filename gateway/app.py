"""The gateway service: gRPC (and OpenAI REST) in front of the aggregated engine or the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cache_svc.config import SemanticCacheConfig
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.grpc_server import start_grpc_server, track_health
from gateway.prepare import RequestPreparer
from gateway.response_cache import BusCacheClient, LocalCacheClient, ResponseCache
from gateway.rest.server import RestServer
from services.bus import subjects
from services.config import EngineConfig, ServiceConfig
from services.models.info import ModelInfo
from services.service import Service
from services.tokenization import load_tokenizer

log = logging.getLogger(__name__)


class Gateway(Service):
    """``aggregated`` runs the engine here (``epd serve all``); otherwise requests go
    E -> P -> D over NATS. The backend owns the bus (no heartbeat: routers route to
    workers, clients find gateways); the drain stops gRPC and REST intake and lets
    their streams finish within the grace."""

    role = subjects.ROLE_GATEWAY

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig, aggregated: bool,
                 api: GatewayConfig | None = None,
                 cache: SemanticCacheConfig | None = None):  # fmt: skip
        super().__init__(config)
        self.engine_config = engine_config
        self.api = api or GatewayConfig()
        self.cache_config = cache or SemanticCacheConfig()
        self._local_cache = None  # serve all: the semantic cache in this process
        self.aggregated = aggregated
        self.core: GatewayCore | None = None
        self.backend = self.grpc_server = self.rest = self._health = None
        self.grpc_port = self.http_port = 0
        self._health_task: asyncio.Task | None = None
        self._intake_closing: list[asyncio.Task] = []

    async def load(self) -> None:
        self.info = ModelInfo.load(self.engine_config)
        self.tokenizer = load_tokenizer(self.info.model_dir, torch_free=True)

    async def connect(self) -> None:
        self.backend = await self._backend()
        await self.backend.start()

    async def register(self) -> None:
        preparer = RequestPreparer(self.info, self.tokenizer, self.config.request_timeout_s,
                                   self.api)  # fmt: skip
        cache = await self._cache(self.backend, self.info)
        self.core = GatewayCore(preparer, self.backend, self.api, cache)
        self.grpc_server, self.grpc_port, self._health = await start_grpc_server(
            self.core, self.config.host, self.config.grpc_port
        )
        self._health_task = asyncio.create_task(
            track_health(self._health, self.core, self.config.heartbeat_s / 2)
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

            return AggregatedBackend(AsyncEngine(LLMEngine(self.engine_config)), self.instance_id)
        from gateway.disaggregated import DisaggregatedBackend

        return DisaggregatedBackend(self.engine_config, self.config, self.instance_id, self.api)

    async def stop_intake(self) -> None:
        """Health says NOT_SERVING (load balancers look elsewhere); both servers refuse
        new calls and get the grace for the open ones."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        closing = []
        if self.grpc_server is not None:
            closing.append(self.grpc_server.stop(self.config.shutdown_grace_s))
        if self.rest is not None:
            closing.append(self.rest.stop())
        for aw in closing:
            task = asyncio.ensure_future(aw)
            task.add_done_callback(lambda _: self.progressed())
            self._intake_closing.append(task)

    def busy(self) -> bool:
        return any(not task.done() for task in self._intake_closing)

    async def release(self) -> None:
        # Past the grace: the servers stop for good before the backend (and its bus) goes.
        await asyncio.gather(*self._intake_closing, return_exceptions=True)
        if self.backend is not None:
            await self.backend.stop()
        if self._local_cache is not None:
            await self._local_cache.stop()
