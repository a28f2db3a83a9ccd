"""``serve all``'s image-embedding cache: an in-process LRU in front of the fleet's Redis.

The aggregated server used to run the vision tower on every image of every request. Here
each image's embedding is looked up first in a small LRU, then in the same Redis store
the encoder service fills (``services/embeddings/store.py``, key
``epd:emb:<model-fingerprint>:<image-sha256>``), so a fleet and an aggregated server on
one Redis share their work. Only a miss in both runs the tower. Redis unavailable, slow
or holding a wrong-shaped value is a miss (every Redis call has the store's timeout),
never a failure; concurrent requests for one image encode it once (singleflight).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from services.embeddings.lru import DEFAULT_BYTES, EmbeddingLRU
from services.embeddings.store import EmbeddingStore
from services.engine.request import ImageSpan
from services.metrics import (
    EMBEDDING_CACHE_BYTES,
    EMBEDDING_CACHE_HITS,
    EMBEDDING_CACHE_MISSES,
    EMBEDDING_SINGLEFLIGHT_JOINS,
)
from services.models.image_grid import ImageOptions
from services.singleflight import SingleFlight

log = logging.getLogger(__name__)

# Encoded image file, processor settings -> its embedding [tokens, hidden] (the tower).
EncodeFn = Callable[[bytes, ImageOptions], Awaitable[torch.Tensor]]


class ImageEmbeddings:
    """``embeddings(images, spans)`` -> one tensor per image, the tower run only on misses."""

    def __init__(
        self,
        encode: EncodeFn,
        store: EmbeddingStore | None,
        fingerprint: str,
        hidden: int,
        dtype: torch.dtype,
        lru_bytes: int = DEFAULT_BYTES,
    ) -> None:
        """``store`` None: no Redis (the LRU alone); ``hidden``/``dtype``: the language
        model's, which a stored value must match to be used."""
        self.encode = encode
        self.store = store
        self.fingerprint = fingerprint
        self.hidden = hidden
        self.dtype = dtype
        self.lru = EmbeddingLRU(lru_bytes)
        self.flight: SingleFlight[str, torch.Tensor] = SingleFlight()

    async def embeddings(
        self, images: list[bytes], spans: list[ImageSpan], options: ImageOptions
    ) -> list[torch.Tensor]:
        """Each image's embedding, in prompt order (``spans`` name their hashes)."""
        if len(images) != len(spans):
            raise ValueError(f"{len(images)} images for {len(spans)} image spans")
        return [
            await self.one(data, span, options) for data, span in zip(images, spans, strict=True)
        ]

    async def one(self, data: bytes, span: ImageSpan, options: ImageOptions) -> torch.Tensor:
        """One image: LRU, else (shared with concurrent callers) Redis, else the tower."""
        emb = self.lru.get(span.image_hash)
        if emb is not None:
            EMBEDDING_CACHE_HITS.inc()
            return emb
        if self.flight.inflight(span.image_hash):
            EMBEDDING_SINGLEFLIGHT_JOINS.inc()
        return await self.flight.do(span.image_hash, lambda: self._load(data, span, options))

    async def _load(self, data: bytes, span: ImageSpan, options: ImageOptions) -> torch.Tensor:
        emb = await self._stored(span)
        if emb is not None:
            EMBEDDING_CACHE_HITS.inc()
        else:
            EMBEDDING_CACHE_MISSES.inc()
            emb = await self.encode(data, options)
            await self._store(span.image_hash, emb)
        self.lru.put(span.image_hash, emb)
        return emb

    async def _stored(self, span: ImageSpan) -> torch.Tensor | None:
        """Redis's value when it fits the span and the model; anything else is a miss."""
        if self.store is None:
            return None
        emb = await self.store.get(self.fingerprint, span.image_hash)
        if emb is None:
            return None
        if (
            emb.dim() != 2
            or list(emb.shape) != [span.length, self.hidden]
            or not emb.is_floating_point()
        ):
            log.warning(
                "stored embedding of image %s is %s %s, expected floats [%d, %d]: "
                "encoding it again",
                span.image_hash[:12],
                emb.dtype,
                list(emb.shape),
                span.length,
                self.hidden,
            )
            return None
        return emb.to(self.dtype)

    async def _store(self, image_hash: str, emb: torch.Tensor) -> None:
        if self.store is not None and await self.store.put(self.fingerprint, image_hash, emb):
            EMBEDDING_CACHE_BYTES.inc(emb.numel() * emb.element_size())
