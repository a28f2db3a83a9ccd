"""Image-embedding cache over Redis, shared by every encoder and prefill instance.

Key ``epd:emb:<model-fingerprint>:<image-sha256>``; value = a small header
(magic, version, dtype, ndim, shape) followed by the raw tensor bytes. Redis is an
optimization, never a dependency: every call has a short timeout, and Redis down,
slow or returning garbage reads as a miss (``get`` -> None, ``put`` -> False). After a
failure the store skips Redis for ``backoff_s`` so a dead Redis costs nothing per call.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.bus.codec import DTYPES, MAX_NDIM, tensor_from_bytes, tensor_to_bytes
from services.embeddings.keys import embedding_key
from services.redis_client import check_redis_url, redis_client

logger = logging.getLogger(__name__)

MAGIC = b"EPDE"
VERSION = 1
# magic, version, dtype code, ndim; then ndim little-endian int64 dimensions.
_HEADER = struct.Struct("<4sBBB")
_DIM = struct.Struct("<q")
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES, start=1)}
_CODE_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}
_FAILURES = (RedisError, OSError, TimeoutError, ConnectionError)

T = TypeVar("T")


def pack_embedding(tensor: torch.Tensor) -> bytes:
    """Serialize a tensor as header + raw bytes."""
    data, name, shape = tensor_to_bytes(tensor)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"embedding has {len(shape)} dims; at most {MAX_NDIM}")
    head = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[name], len(shape))
    return head + b"".join(_DIM.pack(d) for d in shape) + data


def unpack_embedding(value: bytes) -> torch.Tensor:
    """Parse a stored value; ValueError when it is not a valid embedding."""
    if len(value) < _HEADER.size:
        raise ValueError(f"value of {len(value)} bytes is shorter than the header")
    magic, version, code, ndim = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"bad magic/version {magic!r}/{version}")
    if code not in _CODE_DTYPES or ndim > MAX_NDIM:
        raise ValueError(f"bad dtype code {code} or ndim {ndim}")
    start = _HEADER.size + ndim * _DIM.size
    if len(value) < start:
        raise ValueError("value truncated inside the shape")
    shape = [_DIM.unpack_from(value, _HEADER.size + i * _DIM.size)[0] for i in range(ndim)]
    return tensor_from_bytes(memoryview(value)[start:], _CODE_DTYPES[code], shape)


@dataclass(frozen=True)
class EmbeddingStoreConfig:
    """Embedding cache settings. Validated at construction."""

    # Redis URL, e.g. redis://127.0.0.1:6379/0; with a password, TLS or Sentinel as
    # services/redis_client.py describes.
    url: str = "redis://127.0.0.1:6379/0"
    # Limit on every Redis call, connect included.
    op_timeout_s: float = 0.25
    # After a failure, skip Redis (treat as miss) for this long.
    backoff_s: float = 1.0
    # Default time to live of stored embeddings.
    ttl_s: int = 24 * 3600

    def __post_init__(self) -> None:
        check_redis_url(self.url)  # its message masks the password
        if self.op_timeout_s <= 0 or self.backoff_s < 0 or self.ttl_s <= 0:
            raise ValueError("op_timeout_s and ttl_s must be > 0, backoff_s >= 0")


class EmbeddingStore:
    """get/put image embeddings; Redis trouble always reads as a miss."""

    def __init__(self, client: aioredis.Redis, config: EmbeddingStoreConfig) -> None:
        """Use ``EmbeddingStore.from_config`` unless you bring your own client."""
        self._redis = client
        self._config = config
        self._skip_until = 0.0

    @classmethod
    def from_config(cls, config: EmbeddingStoreConfig) -> EmbeddingStore:
        """Build a store with a client whose sockets time out like the store's calls."""
        client = redis_client(
            config.url,
            socket_timeout=config.op_timeout_s,
            socket_connect_timeout=config.op_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, config)

    async def get(self, fingerprint: str, image_hash: str) -> torch.Tensor | None:
        """The stored embedding, or None (absent, corrupt, or Redis unavailable)."""
        key = embedding_key(fingerprint, image_hash)
        value = await self._call("GET", key, lambda: self._redis.get(key))
        if value is None:
            return None
        try:
            return unpack_embedding(value)
        except ValueError as exc:
            logger.warning("corrupt embedding key=%s: %s; treating as a miss", key, exc)
            return None

    async def put(
        self, fingerprint: str, image_hash: str, tensor: torch.Tensor, ttl_s: int | None = None
    ) -> bool:
        """Store an embedding with a TTL; False when Redis is unavailable."""
        key = embedding_key(fingerprint, image_hash)
        value = pack_embedding(tensor)
        ttl = ttl_s if ttl_s is not None else self._config.ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        ok = await self._call("SET", key, lambda: self._redis.set(key, value, ex=ttl))
        return bool(ok)

    async def close(self) -> None:
        """Close the client's connections. Safe to call twice."""
        try:
            await self._redis.aclose()
        except _FAILURES as exc:
            logger.debug("redis close failed: %r", exc)

    async def _call(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T | None:
        """Run one Redis call under the timeout; None on any failure (and back off)."""
        if time.monotonic() < self._skip_until:
            return None
        try:
            return await asyncio.wait_for(fn(), timeout=self._config.op_timeout_s)
        except _FAILURES as exc:
            self._skip_until = time.monotonic() + self._config.backoff_s
            logger.warning("redis %s failed key=%s: %r; treating as a miss", op, key, exc)
            return None
