"""Sentence embeddings for the router, from the cache service (``epd.cache.embed``).

The gateway imports no torch: the cache service owns the MiniLM model and answers over
the bus (any replica). ``epd serve all`` and the benchmark use ``LocalEmbedder`` around
a model in the same process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from cache_svc.embed_handler import MAX_TEXTS, vectors_from_proto
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.connection import Bus

EMBED_SUBJECT = subjects.cache("embed")


class Embedder(Protocol):
    async def embed(self, texts: list[str], timeout_s: float) -> np.ndarray:
        """float32 [len(texts), dim] unit vectors; raises when slow or unavailable."""
        ...


class BusEmbedder:
    """Asks the cache service; long lists go in requests of MAX_TEXTS texts."""

    def __init__(self, bus: Bus):
        self.bus = bus

    async def embed(self, texts: list[str], timeout_s: float) -> np.ndarray:
        parts = [texts[i : i + MAX_TEXTS] for i in range(0, len(texts), MAX_TEXTS)]
        rows = await asyncio.gather(*(self._ask(p, timeout_s) for p in parts))
        return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)

    async def _ask(self, texts: list[str], timeout_s: float) -> np.ndarray:
        reply = await self.bus.request(
            EMBED_SUBJECT, bus_pb2.EmbedRequest(texts=texts), bus_pb2.EmbedReply, timeout_s
        )
        if reply.HasField("error"):
            raise RuntimeError(f"cache service: {reply.error.message}")
        return vectors_from_proto(reply.vectors, len(texts))


class LocalEmbedder:
    """An in-process ``await embed_one(text) -> vector`` (a SentenceBatcher's ``embed``)."""

    def __init__(self, embed_one: Callable[[str], Awaitable[np.ndarray]]):
        self.embed_one = embed_one

    async def embed(self, texts: list[str], timeout_s: float) -> np.ndarray:
        rows = await asyncio.wait_for(
            asyncio.gather(*(self.embed_one(t) for t in texts)), timeout_s
        )
        return np.stack(rows).astype(np.float32)
