"""The cache service: the semantic response cache behind ``epd.cache.lookup`` and
``epd.cache.store`` (queue group: any replica answers), over Redis shared by all.

It owns the sentence-embedding model, so the gateway needs no torch. Lookups of
concurrent requests share embedding passes (SentenceBatcher); each replica keeps a vector
index that follows every replica's writes (semantic.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from cache_svc.answers import AnswerStore
from cache_svc.config import SemanticCacheConfig
from cache_svc.embedder import SentenceBatcher, SentenceEmbedder
from cache_svc.semantic import SemanticCache
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.handlers import Incoming
from services.bus.heartbeat import HeartbeatPublisher, Load
from services.config import ServiceConfig
from services.runtime import connect_bus

log = logging.getLogger(__name__)


async def open_cache(redis_url: str, config: SemanticCacheConfig) -> SemanticCache:
    """A started SemanticCache (the model loads in a thread); ``epd serve all`` uses one
    in its own process."""
    embedder = await asyncio.to_thread(SentenceEmbedder)
    await asyncio.to_thread(embedder, ["warm up"])  # the first pass is several times slower
    cache = SemanticCache(AnswerStore(redis_url), SentenceBatcher(embedder), config)
    await cache.start()
    return cache


class CacheService:
    role = subjects.ROLE_CACHE

    def __init__(self, config: ServiceConfig, cache_config: SemanticCacheConfig | None = None):
        self.config = config
        self.cache_config = cache_config or SemanticCacheConfig()
        self.instance_id = config.instance_id or f"cache-{uuid.uuid4().hex[:8]}"
        self.bus = self.cache = self.heartbeat = None
        self.in_flight = 0
        self._stopped = False

    async def start(self) -> None:
        # Lookups are one short sentence each (batched when concurrent): one thread, not
        # a team that oversubscribes the cores the engine services share.
        torch.set_num_threads(1)
        self.cache = await open_cache(self.config.redis_url, self.cache_config)
        self.bus = await connect_bus(self.config, self.instance_id)
        for subject, handler in ((subjects.CACHE_LOOKUP, self._on_lookup),
                                 (subjects.CACHE_STORE, self._on_store)):  # fmt: skip
            await self.bus.subscribe(subject, handler, queue=subjects.QUEUE_CACHE,
                                     max_concurrency=256)  # fmt: skip
        self.heartbeat = HeartbeatPublisher(self.bus, self.role, self.instance_id,
                                            lambda: Load(running=self.in_flight),
                                            interval_s=self.config.heartbeat_s)  # fmt: skip
        await self.heartbeat.start()
        log.info("cache %s ready (%d entries)", self.instance_id, len(self.cache.index))

    async def _on_lookup(self, msg: Incoming) -> None:
        await self._answer(msg, msg.decode(bus_pb2.CacheQuery), self.cache.lookup)

    async def _on_store(self, msg: Incoming) -> None:
        await self._answer(msg, msg.decode(bus_pb2.CacheStoreRequest), self.cache.put)

    async def _answer(self, msg: Incoming, request, handle) -> None:
        self.in_flight += 1
        try:
            await msg.respond(await handle(request))
        finally:
            self.in_flight -= 1

    async def stop(self) -> None:
        """Heartbeats off, drain the bus (lookups in flight finish), close; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.bus is not None:
            await self.bus.close()
        if self.cache is not None:
            await self.cache.stop()
