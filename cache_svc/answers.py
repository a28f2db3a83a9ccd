"""Cached answers in Redis, shared by every cache replica (and so by every gateway).

- ``epd:sc:e:<key>``: hash of one entry (fingerprint, question, its vector, the answer,
  tenant); expires after the TTL.
- ``epd:sc:x:<exact>``: the entry of an exact request (the exact tier); same TTL.
- ``epd:sc:lru`` and ``epd:sc:t:<tenant>``: entries by age, for the size bound and the
  per-tenant quota (oldest evicted first).
- ``epd:sc:log``: a stream of adds and deletes; every replica follows it to keep its
  vector index in step with the others (and rebuilds from the entries at start).

Every call has a timeout; the callers turn failures into misses.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cache_svc.index import DIM
from services.redis_client import redis_client

PREFIX = "epd:sc"
LOG = f"{PREFIX}:log"
LRU = f"{PREFIX}:lru"
_LOG_LEN = 200_000  # the stream is a change feed, not the store: entries live in hashes


def _entry(key: int) -> str:
    return f"{PREFIX}:e:{key}"


def _tenant(tenant: str) -> str:
    return f"{PREFIX}:t:{tenant}"


@dataclass
class Entry:
    key: int
    fingerprint: str
    question: str
    answer: bytes  # a serialized CachedAnswer


@dataclass
class Change:
    """One line of the change log: an entry added (with its vector) or deleted."""

    added: bool
    key: int
    fingerprint: str = ""
    vector: np.ndarray | None = None


class AnswerStore:
    def __init__(self, url: str, op_timeout_s: float = 0.5, follow_block_ms: int = 500):
        self.follow_block_ms = follow_block_ms
        kw = dict(socket_connect_timeout=op_timeout_s, retry=Retry(NoBackoff(), 0))
        self.redis = redis_client(url, socket_timeout=op_timeout_s, **kw)
        # The follower blocks on the stream: its own connection, a longer timeout.
        self.feed = redis_client(url, socket_timeout=op_timeout_s + follow_block_ms / 1e3, **kw)

    async def close(self) -> None:
        for client in (self.redis, self.feed):
            await client.aclose()

    async def exact(self, exact_key: str) -> int | None:
        key = await self.redis.get(f"{PREFIX}:x:{exact_key}")
        return None if key is None else int(key)

    async def entries(self, keys: list[int]) -> list[Entry | None]:
        """The entries (None: expired or evicted), in the order of ``keys``."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(_entry(key), "fp", "q", "a")
        rows = await pipe.execute()
        return [
            Entry(k, fp.decode(), q.decode(), a) if a is not None else None
            for k, (fp, q, a) in zip(keys, rows, strict=True)
        ]

    async def put(
        self,
        fingerprint: str,
        exact_key: str,
        question: str,
        vector: np.ndarray,
        answer: bytes,
        tenant: str,
        ttl_s: int,
    ) -> int:
        """Store one entry; returns its key."""
        key, now = secrets.randbits(63), time.time()
        vec = np.asarray(vector, np.float32).tobytes()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(
            _entry(key),
            mapping={"fp": fingerprint, "q": question, "v": vec, "a": answer, "t": tenant},
        )
        pipe.expire(_entry(key), ttl_s)
        pipe.set(f"{PREFIX}:x:{exact_key}", key, ex=ttl_s)
        pipe.zadd(LRU, {key: now})
        if tenant:
            pipe.zadd(_tenant(tenant), {key: now})
            pipe.expire(_tenant(tenant), ttl_s)
        pipe.xadd(
            LOG,
            {"op": "add", "k": key, "fp": fingerprint, "v": vec},
            maxlen=_LOG_LEN,
            approximate=True,
        )
        await pipe.execute()
        return key

    async def evict(self, ttl_s: int, max_entries: int, tenant: str, quota: int) -> int:
        """Drop what is past its TTL, over the size bound, over the tenant's quota;
        returns how many entries went."""
        now = time.time()
        # The three reads in one round trip: this runs after every store.
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(LRU, "-inf", now - ttl_s)
        pipe.zcard(LRU)
        pipe.zcard(_tenant(tenant))
        expired, size, tenant_size = await pipe.execute()
        gone = [int(k) for k in expired]
        over = size - len(gone) - max_entries
        if over > 0:
            gone += [int(k) for k, _ in await self.redis.zpopmin(LRU, over + len(gone))]
        if tenant and quota:
            over = tenant_size - quota
            if over > 0:
                gone += [int(k) for k, _ in await self.redis.zpopmin(_tenant(tenant), over)]
        if gone:
            await self.delete(sorted(set(gone)))
        return len(set(gone))

    async def delete(self, keys: list[int]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.delete(_entry(key))
            pipe.zrem(LRU, key)
            pipe.xadd(LOG, {"op": "del", "k": key}, maxlen=_LOG_LEN, approximate=True)
        await pipe.execute()

    async def log_position(self) -> str:
        """The id of the newest change (follow from there after a scan)."""
        last = await self.redis.xrevrange(LOG, count=1)
        return last[0][0].decode() if last else "0-0"

    async def scan(self):
        """Every live entry with a question as a Change (for an index rebuilt at start),
        read a thousand at a time."""
        names = []
        async for name in self.redis.scan_iter(match=f"{PREFIX}:e:*", count=1000):
            names.append(name)
            if len(names) == 1000:
                for change in await self._changes(names):
                    yield change
                names = []
        for change in await self._changes(names):
            yield change

    async def _changes(self, names: list[bytes]) -> list[Change]:
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "fp", "v")
        changes = []
        for name, (fp, vec) in zip(names, await pipe.execute() if names else [], strict=True):
            key = name.decode().rsplit(":", 1)[1]
            if fp is None or vec is None or len(vec) != DIM * 4 or not key.isdigit():
                continue  # gone meanwhile, or not ours
            vector = np.frombuffer(vec, np.float32)
            if np.isfinite(vector).all() and vector.any():  # no question: exact tier only
                changes.append(Change(True, int(key), fp.decode(), vector))
        return changes

    async def follow(self, position: str) -> tuple[str, list[Change]]:
        """Changes after ``position`` (waits up to follow_block_ms); the new position."""
        reply = await self.feed.xread({LOG: position}, block=self.follow_block_ms, count=1000)
        changes = []
        for _, rows in reply or []:
            for msg_id, fields in rows:
                position = msg_id.decode()
                changes.append(_change(fields))
        return position, [c for c in changes if c is not None]


def _change(fields: dict) -> Change | None:
    """A stream row, validated (nothing from Redis is trusted blindly)."""
    try:
        key = int(fields[b"k"])
        if fields[b"op"] == b"del":
            return Change(False, key)
        vec = np.frombuffer(fields[b"v"], np.float32)
        if vec.shape != (DIM,) or not np.isfinite(vec).all():
            return None
        return Change(True, key, fields[b"fp"].decode(), vec)
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
