"""The cache service: the semantic response cache behind ``epd.cache.lookup`` and
``epd.cache.store`` (queue group: any replica answers), over Redis shared by all.

It owns the sentence-embedding model, so the gateway needs no torch. Lookups of
concurrent requests share embedding passes (SentenceBatcher); each replica keeps a vector
index that follows every replica's writes (semantic.py).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from cache_svc.answers import AnswerStore
from cache_svc.config import SemanticCacheConfig
from cache_svc.embed_handler import EmbedHandler
from cache_svc.embedder import SentenceBatcher, SentenceEmbedder
from cache_svc.semantic import SemanticCache
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.handlers import Incoming
from services.config import ServiceConfig
from services.service import Service

log = logging.getLogger(__name__)


async def open_cache(redis_url: str, config: SemanticCacheConfig) -> SemanticCache:
    """A started SemanticCache (the model loads in a thread); ``epd serve all`` uses one
    in its own process."""
    embedder = await asyncio.to_thread(SentenceEmbedder, None, config.cache_embed_dtype)
    await asyncio.to_thread(embedder, ["warm up"])  # the first pass is several times slower
    cache = SemanticCache(AnswerStore(redis_url), SentenceBatcher(embedder), config)
    await cache.start()
    return cache


class CacheService(Service):
    """The semantic response cache over the bus; in flight = the handlers running."""

    role = subjects.ROLE_CACHE

    def __init__(self, config: ServiceConfig, cache_config: SemanticCacheConfig | None = None):
        super().__init__(config)
        self.cache_config = cache_config or SemanticCacheConfig()
        self.cache: SemanticCache | None = None

    async def load(self) -> None:
        # Lookups are one short sentence each (batched when concurrent): one thread, not
        # a team that oversubscribes the cores the engine services share.
        torch.set_num_threads(1)
        self.cache = await open_cache(self.config.redis_url, self.cache_config)
        self.cache.name = self.instance_id

    async def register(self) -> None:
        # Any replica answers: the drain leaves both queue groups to the others.
        for subject, handler in (
            (subjects.CACHE_LOOKUP, self._on_lookup),
            (subjects.CACHE_STORE, self._on_store),
        ):
            await self.serve_work(subject, handler, queue=subjects.QUEUE_CACHE, max_concurrency=256)
        # Full lookups sent here because this replica is embedding their text (named in
        # the exact miss's reply); taken while draining too: that embedding is under way.
        await self.serve_work(
            subjects.cache_lookup_at(self.instance_id),
            self._on_lookup,
            max_concurrency=256,
            while_draining=True,
        )
        # The semantic router's embeddings share the cache's batcher (one model pass).
        self._embed = EmbedHandler(self.cache.embed)
        await self.serve_work(
            subjects.cache("embed"), self._on_embed, queue=subjects.QUEUE_CACHE, max_concurrency=256
        )
        log.info("cache %s holds %d entries", self.instance_id, len(self.cache.index))

    async def _on_lookup(self, msg: Incoming) -> None:
        await msg.respond(await self.cache.lookup(msg.decode(bus_pb2.CacheQuery)))

    async def _on_embed(self, msg: Incoming) -> None:
        await msg.respond(await self._embed.embed(msg.decode(bus_pb2.EmbedRequest)))

    async def _on_store(self, msg: Incoming) -> None:
        await msg.respond(await self.cache.put(msg.decode(bus_pb2.CacheStoreRequest)))

    async def release(self) -> None:
        if self.cache is not None:
            await self.cache.stop()
