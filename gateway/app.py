"""The gateway service: gRPC (and OpenAI REST) in front of the aggregated engine or the
fleet; over the fleet, of one model or several (one core each, gateway/models.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence

from cache_svc.config import SemanticCacheConfig
from gateway.cache_client import BusCacheClient, LocalCacheClient
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.fleet_link import FleetLink
from gateway.grpc_server import start_grpc_server, track_health
from gateway.models import ModelSet
from gateway.prepare import RequestPreparer
from gateway.response_cache import ResponseCache
from gateway.rest.server import RestServer
from services.bus import subjects
from services.config import EngineConfig, ServiceConfig
from services.models.info import ModelInfo
from services.service import Service
from services.tokenization import load_tokenizer

log = logging.getLogger(__name__)


class Gateway(Service):
    """``aggregated`` runs the engine here (``epd serve all``); otherwise requests go
    E -> P -> D over NATS. The fleet link owns the bus (no heartbeat: routers route to
    workers, clients find gateways); the drain stops gRPC and REST intake and lets
    their streams finish within the grace.

    ``models`` (else ``api.models``, else the engine config's one model): the
    checkpoints served, each by its own instances on the bus; the first is the default
    of requests that name none. ``core`` is the default model's."""

    role = subjects.ROLE_GATEWAY

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServiceConfig,
        aggregated: bool,
        api: GatewayConfig | None = None,
        cache: SemanticCacheConfig | None = None,
        models: Sequence[str] | None = None,
    ):
        super().__init__(config)
        self.api = api or GatewayConfig()
        names = list(models or self.api.models or (engine_config.model,))
        if aggregated and len(names) > 1:
            raise ValueError(
                "'serve all' runs one model in this process; serve several "
                "over the fleet (epd up --model A --model B)"
            )
        self.engine_configs = [dataclasses.replace(engine_config, model=m) for m in names]
        self.engine_config = self.engine_configs[0]
        self.link: FleetLink | None = None
        self.backends: list = []
        self.models: ModelSet | None = None
        self.cache_config = cache or SemanticCacheConfig()
        self._local_cache = None  # serve all: the semantic cache in this process
        self._router = None  # the semantic router's config watcher (--router-config)
        self.aggregated = aggregated
        self.core: GatewayCore | None = None
        self.backend = self.grpc_server = self.rest = self._health = None
        self.grpc_port = self.http_port = 0
        self._health_task: asyncio.Task | None = None
        self._intake_closing: list[asyncio.Task] = []

    async def load(self) -> None:
        self.infos = [ModelInfo.load(c) for c in self.engine_configs]
        self.tokenizers = [load_tokenizer(i.model_dir, torch_free=True) for i in self.infos]
        self.info, self.tokenizer = self.infos[0], self.tokenizers[0]

    async def connect(self) -> None:
        if not self.aggregated:  # one bus connection and registry for every model
            self.link = FleetLink(self.config, self.instance_id)
            await self.link.start()
        self.backends = [self._backend(c) for c in self.engine_configs]
        self.backend = self.backends[0]
        for backend in self.backends:
            await backend.start()

    async def register(self) -> None:
        cores = []
        for info, tokenizer, backend in zip(
            self.infos, self.tokenizers, self.backends, strict=True
        ):
            preparer = RequestPreparer(info, tokenizer, self.config.request_timeout_s, self.api)
            cores.append(GatewayCore(preparer, backend, self.api, await self._cache(backend, info)))
        self.models = ModelSet(cores)
        self.core = self.models.default
        if self.api.router_config:  # a bad file stops the start, naming the field
            from gateway.semantic_router.hook import embedder_for, start_router

            bus = self.link.bus if self.link is not None else None
            self._router = await start_router(
                self.api.router_config, self.models, embedder_for(bus, self._local_cache)
            )
        self.grpc_server, self.grpc_port, self._health = await start_grpc_server(
            self.models, self.config.host, self.config.grpc_port
        )
        self._health_task = asyncio.create_task(
            track_health(self._health, self.models, self.config.heartbeat_s / 2)
        )
        self.rest = RestServer(self.models, self.config.host, self.api.http_port)
        await self.rest.start()
        self.http_port = self.rest.port
        log.info(
            "gateway %s serving %s: gRPC on port %d, REST on port %d",
            self.instance_id,
            ", ".join(self.models.names),
            self.grpc_port,
            self.http_port,
        )

    async def _cache(self, backend, info: ModelInfo) -> ResponseCache | None:
        """The response cache: the cache service over the bus (fleet), or one in this
        process (serve all: it runs the engine, so the embedding model may live here)."""
        if not self.cache_config.cache_enabled:
            return None
        if self.aggregated:
            from cache_svc.service import open_cache

            self._local_cache = await open_cache(self.config.redis_url, self.cache_config)
            client = LocalCacheClient(self._local_cache, backend.busy)
        else:
            client = BusCacheClient(backend.bus)
        return ResponseCache(client, self.cache_config, info.fingerprint)

    def _backend(self, engine_config: EngineConfig):
        if self.aggregated:
            from gateway.aggregated import AggregatedBackend
            from services.embeddings.store import EmbeddingStoreConfig
            from services.engine.async_engine import AsyncEngine
            from services.engine.llm_engine import LLMEngine

            store = EmbeddingStoreConfig(
                url=self.config.redis_url, ttl_s=self.config.embedding_ttl_s
            )
            return AggregatedBackend(AsyncEngine(LLMEngine(engine_config)), self.instance_id, store)
        from gateway.disaggregated import DisaggregatedBackend

        return DisaggregatedBackend(
            engine_config, self.config, self.instance_id, self.api, self.link
        )

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
        if self._router is not None:
            await self._router.stop()
        for backend in self.backends:
            await backend.stop()
        if self.link is not None:
            await self.link.stop()
        if self._local_cache is not None:
            await self._local_cache.stop()
