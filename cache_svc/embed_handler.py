"""``epd.cache.embed``: the cache service's sentence embeddings for other services.

The semantic router (gateway/semantic_router/) compares the last user message with each
route's example utterances and with known attack prompts; the gateway has no torch, so it
asks here. Texts of concurrent requests share model passes with the cache's own lookups
(one SentenceBatcher), and any replica of the queue group answers. This module imports no
torch: the gateway decodes replies with ``vectors_from_proto``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from protos.epd_pb import bus_pb2

if TYPE_CHECKING:  # the batcher's module loads torch
    from cache_svc.embedder import SentenceBatcher

log = logging.getLogger(__name__)

# A config load embeds every example utterance at once; one reply of this many vectors is
# 384 KiB, well under NATS's default 1 MiB max_payload.
MAX_TEXTS = 256
MAX_CHARS = 32_000  # per text: the model reads 256 tokens, the rest is only hashing cost


def check_embed_request(req: bus_pb2.EmbedRequest) -> list[str]:
    """The texts of a request; ValueError naming what is out of bounds."""
    if not 0 < len(req.texts) <= MAX_TEXTS:
        raise ValueError(f"texts must hold 1..{MAX_TEXTS} entries, got {len(req.texts)}")
    for i, text in enumerate(req.texts):
        if len(text) > MAX_CHARS:
            raise ValueError(f"texts[{i}] is longer than {MAX_CHARS} characters")
    return list(req.texts)


def vectors_to_proto(vectors: np.ndarray) -> bus_pb2.Tensor:
    """float32 [n, dim] -> a Tensor message (little-endian bytes)."""
    arr = np.ascontiguousarray(vectors, dtype="<f4")
    return bus_pb2.Tensor(data=arr.tobytes(), dtype="float32", shape=list(arr.shape))


def vectors_from_proto(msg: bus_pb2.Tensor, rows: int) -> np.ndarray:
    """The float32 [rows, dim] unit vectors of a reply; ValueError when malformed."""
    if msg.dtype != "float32" or len(msg.shape) != 2 or msg.shape[0] != rows:
        raise ValueError(
            f"expected float32 [{rows}, dim] vectors, got {msg.dtype} {list(msg.shape)}"
        )
    if not 0 < msg.shape[1] <= 4096 or len(msg.data) != 4 * rows * msg.shape[1]:
        raise ValueError("embedding reply: size does not match its shape")
    vectors = np.frombuffer(msg.data, dtype="<f4").reshape(rows, msg.shape[1])
    if not np.isfinite(vectors).all():
        raise ValueError("embedding reply: non-finite values")
    return vectors.astype(np.float32)


class EmbedHandler:
    """Answers EmbedRequests with the vectors of their texts (errors as values)."""

    def __init__(self, batcher: SentenceBatcher):
        self.batcher = batcher

    async def embed(self, req: bus_pb2.EmbedRequest) -> bus_pb2.EmbedReply:
        """The reply for one request; a bad request or a failed pass is an ``error``."""
        try:
            texts = check_embed_request(req)
            rows = await asyncio.gather(*(self.batcher.embed(t) for t in texts))
            vectors = np.stack(rows)
        except ValueError as e:
            code = bus_pb2.ERROR_CODE_INVALID_ARGUMENT
            return bus_pb2.EmbedReply(error=bus_pb2.Error(code=code, message=str(e)))
        except Exception as e:  # the model failed: the caller treats it as unavailable
            log.warning("embedding failed: %s", e)
            code = bus_pb2.ERROR_CODE_UNAVAILABLE
            return bus_pb2.EmbedReply(error=bus_pb2.Error(code=code, message=str(e)))
        return bus_pb2.EmbedReply(vectors=vectors_to_proto(vectors))
