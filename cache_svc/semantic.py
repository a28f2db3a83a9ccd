"""The semantic response cache: lookups and stores over the shared answer store.

A lookup tries the exact tier (the whole canonical request) first, then the semantic
tier: the nearest stored questions of the same fingerprint by cosine of their sentence
embeddings, each above the threshold checked by the guard (guard.py) and for
``max_tokens`` (an answer cut at "length" serves only the same max_tokens; a finished
one only requests that allow as many tokens). The vector index follows the other
replicas' writes through the store's change log and is rebuilt from Redis at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

import numpy as np

from cache_svc.answers import AnswerStore, Change
from cache_svc.config import SemanticCacheConfig
from cache_svc.embedder import DIM, SentenceBatcher
from cache_svc.guard import conflict, facts
from cache_svc.index import Graph, SemanticIndex
from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb
from services.metrics import (
    SEMANTIC_CACHE_ENTRIES,
    SEMANTIC_CACHE_GUARD,
    SEMANTIC_CACHE_LOOKUP_SECONDS,
    SEMANTIC_CACHE_LOOKUPS,
    SEMANTIC_CACHE_STORES,
)

log = logging.getLogger(__name__)
_CANDIDATES = 8  # nearest questions checked per lookup
# Entries handed to a graph-building thread at once: ~5-10 s of work here, so a stopping
# service waits at most that long for a thread it cannot cancel.
_BUILD_STEP = 5_000
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_TEXT = 32_000


def check_query(q: bus_pb2.CacheQuery) -> None:
    """Nothing from the bus is used unchecked: ValueError naming the bad field."""
    for name in ("fingerprint", "exact_key"):
        if not _HEX64.fullmatch(getattr(q, name)):
            raise ValueError(f"{name} must be 64 lowercase hex characters")
    if len(q.text) > _MAX_TEXT or len(q.tenant) > 256 or q.max_tokens < 0:
        raise ValueError("text, tenant or max_tokens out of bounds")
    if q.vector:
        vec = np.frombuffer(q.vector, dtype="<f4") if len(q.vector) == 4 * DIM else None
        if vec is None or not np.isfinite(vec).all() or abs(float(vec @ vec) - 1.0) > 1e-3:
            raise ValueError(f"vector must be {DIM} finite float32 values of unit length")


async def embedding_of(q: bus_pb2.CacheQuery, embed: SentenceBatcher) -> np.ndarray:
    """The query text's vector: the one the gateway sent (its router already asked for
    it; check_query validated it), else one embedding pass here."""
    if q.vector:
        return np.frombuffer(q.vector, dtype="<f4").astype(np.float32)
    return await embed.embed(q.text)


def check_answer(answer: bus_pb2.CachedAnswer) -> None:
    if not 0 < len(answer.choices) <= 256 or answer.max_tokens < 0:
        raise ValueError("an answer needs 1..256 choices and max_tokens >= 0")
    if any(len(c.token_ids) > 1 << 20 or min(c.token_ids, default=0) < 0 for c in answer.choices):
        raise ValueError("answer token ids out of bounds")


def fits(answer: bus_pb2.CachedAnswer, max_tokens: int) -> bool:
    """Whether a stored answer may serve a request allowing ``max_tokens`` tokens."""
    longest = max((len(c.token_ids) for c in answer.choices), default=0)
    cut = any(c.finish_reason == pb.FINISH_REASON_LENGTH for c in answer.choices)
    return answer.max_tokens == max_tokens if cut else longest <= max_tokens


class SemanticCache:
    def __init__(self, store: AnswerStore, embed: SentenceBatcher, config: SemanticCacheConfig):
        self.store, self.embed, self.config = store, embed, config
        # This replica's instance id, named in an exact miss's reply (the full lookup then
        # comes to it); empty in one process (``epd serve all``).
        self.name = ""
        self.index = SemanticIndex(config.cache_ann_from)
        self._follower: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # graph builds
        self._stopping = False

    async def start(self) -> None:
        """Rebuild the index from Redis, then follow the change log (in the background;
        with Redis down, both wait until it is back and lookups miss meanwhile)."""
        ready = asyncio.Event()
        self._follower = asyncio.create_task(self._follow(ready))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ready.wait(), timeout=2)  # Redis down: serve (misses) anyway

    async def _rebuild(self) -> str:
        """A fresh index from every entry in Redis, filled in a thread (lookups meanwhile
        search the old one: at start, empty); returns where to follow the log from."""
        position = await self.store.log_position()
        fresh, pending, count = SemanticIndex(self.config.cache_ann_from), {}, 0

        def fill(batch: dict[str, tuple[list[int], list[np.ndarray]]]) -> None:
            for fingerprint, (keys, vectors) in batch.items():
                fresh.add_many(fingerprint, keys, np.stack(vectors))

        async for change in self.store.scan():
            if self._stopping:
                break
            keys, vectors = pending.setdefault(change.fingerprint, ([], []))
            keys.append(change.key)
            vectors.append(change.vector)
            count += 1
            if count % _BUILD_STEP == 0:
                await asyncio.to_thread(fill, pending)
                pending = {}
        await asyncio.to_thread(fill, pending)
        self.index = fresh  # what was stored meanwhile is in the log after `position`
        SEMANTIC_CACHE_ENTRIES.set(len(self.index))
        log.info("semantic cache index rebuilt: %d entries", len(self.index))
        return position

    def _add(self, fingerprint: str, key: int, vec: np.ndarray) -> None:
        if self.index.add(fingerprint, key, vec):  # due a graph: built in a thread
            task = asyncio.create_task(self._grow(self.index, fingerprint))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _grow(self, index: SemanticIndex, fingerprint: str) -> None:
        """Build the graph of a bucket in steps, each in a thread; swap it in when whole
        (a failure or a stop leaves the bucket exact; the next add tries again)."""
        keys, vectors = index.snapshot(fingerprint)
        graph, whole = Graph([], vectors[:0]), False
        try:
            for lo in range(0, len(keys), _BUILD_STEP):
                if self._stopping:
                    return
                hi = lo + _BUILD_STEP
                await asyncio.to_thread(graph.add_many, keys[lo:hi], vectors[lo:hi])
            whole = True
        except Exception as e:
            log.warning("semantic cache graph build failed: %s", e)
        finally:
            index.install(fingerprint, graph if whole else None, keys)

    async def stop(self) -> None:
        """Let the follower leave between reads (cancelling redis-py inside a blocking
        XREAD can leave the task hanging), then close."""
        self._stopping = True
        if self._follower is not None:
            limit = self.store.follow_block_ms / 1e3 + 2.0
            done, _ = await asyncio.wait({self._follower}, timeout=limit)
            if not done:
                self._follower.cancel()
        await self.store.close()

    async def lookup(self, q: bus_pb2.CacheQuery) -> bus_pb2.CacheLookupReply:
        """The reply to a gateway; metrics count requests, so an exact-only lookup that
        misses (the gateway's full lookup follows) is not counted."""
        started = time.perf_counter()
        try:
            check_query(q)
            reply = await self._lookup(q)
            result = f"hit_{reply.tier}" if reply.hit else "miss"
        except Exception as e:  # a cache that fails is a miss
            log.warning("semantic cache lookup failed: %s", e)
            reply, result = bus_pb2.CacheLookupReply(), "error"
            reply.error.CopyFrom(_error(e))
        if not q.exact_only or reply.hit:
            SEMANTIC_CACHE_LOOKUPS.labels(result).inc()
            SEMANTIC_CACHE_LOOKUP_SECONDS.observe(time.perf_counter() - started)
        return reply

    async def _lookup(self, q: bus_pb2.CacheQuery) -> bus_pb2.CacheLookupReply:
        # The question's embedding (the long part) starts beside the exact tier's read.
        vec = None
        if q.text and not q.exact_only:
            vec = asyncio.ensure_future(embedding_of(q, self.embed))
            vec.add_done_callback(lambda f: f.cancelled() or f.exception())  # read once
        try:
            key = await self.store.exact(q.exact_key)
            hit = await self._answer(key, q) if key is not None else None
        except BaseException:
            if vec is not None:
                vec.cancel()
            raise
        if hit is not None:
            if vec is not None:
                vec.cancel()
            return bus_pb2.CacheLookupReply(hit=True, tier="exact", similarity=1.0, answer=hit)
        if vec is None:
            return self._exact_miss(q)
        return await self._semantic(q, await vec)

    def _exact_miss(self, q: bus_pb2.CacheQuery) -> bus_pb2.CacheLookupReply:
        """The reply to a miss without the semantic tier. After an exact-only miss the
        gateway's full lookup follows, so the text's embedding (the long part) starts now
        rather than a round trip later, and the reply names this replica for it."""
        if not (q.exact_only and q.text and not q.vector):
            return bus_pb2.CacheLookupReply()
        self.embed.prefetch(q.text)
        return bus_pb2.CacheLookupReply(embedding_on=self.name)

    async def _semantic(self, q: bus_pb2.CacheQuery, vec: np.ndarray) -> bus_pb2.CacheLookupReply:
        """The nearest stored questions of the fingerprint, best first, through the guard."""
        found = self.index.search(q.fingerprint, vec, _CANDIDATES, self.config.cache_threshold)
        entries = await self.store.entries([k for k, _ in found]) if found else []
        mine = facts(q.text)
        for (key, score), entry in zip(found, entries, strict=True):
            if entry is None or entry.fingerprint != q.fingerprint:
                self.index.remove(key)  # expired or evicted: the log may not have said yet
                continue
            why = conflict(facts(entry.question), mine)
            if why is not None:
                SEMANTIC_CACHE_GUARD.labels(why).inc()
                continue
            answer = bus_pb2.CachedAnswer.FromString(entry.answer)
            if fits(answer, q.max_tokens):
                return bus_pb2.CacheLookupReply(
                    hit=True, tier="semantic", similarity=score, answer=answer
                )
        return bus_pb2.CacheLookupReply()

    async def _answer(self, key: int, q: bus_pb2.CacheQuery) -> bus_pb2.CachedAnswer | None:
        (entry,) = await self.store.entries([key])
        if entry is None or entry.fingerprint != q.fingerprint:
            return None
        answer = bus_pb2.CachedAnswer.FromString(entry.answer)
        return answer if fits(answer, q.max_tokens) else None

    async def put(self, req: bus_pb2.CacheStoreRequest) -> bus_pb2.CacheStoreReply:
        q, c = req.query, self.config
        try:
            check_query(q)
            check_answer(req.answer)
            vec = await embedding_of(q, self.embed) if q.text else np.zeros(DIM, np.float32)
            key = await self.store.put(
                q.fingerprint,
                q.exact_key,
                q.text,
                vec,
                req.answer.SerializeToString(),
                q.tenant,
                c.cache_ttl_s,
            )
            if q.text:
                self._add(q.fingerprint, key, vec)
            await self.store.evict(
                c.cache_ttl_s, c.cache_max_entries, q.tenant, c.cache_tenant_quota
            )
        except Exception as e:
            log.warning("semantic cache store failed: %s", e)
            SEMANTIC_CACHE_STORES.labels("error").inc()
            reply = bus_pb2.CacheStoreReply()
            reply.error.CopyFrom(_error(e))
            return reply
        SEMANTIC_CACHE_STORES.labels("stored").inc()
        SEMANTIC_CACHE_ENTRIES.set(len(self.index))
        return bus_pb2.CacheStoreReply(stored=True)

    async def _follow(self, ready: asyncio.Event) -> None:
        """Rebuild, then apply the other replicas' changes within follow_block_ms."""
        position = None
        while not self._stopping:
            try:
                if position is None:
                    position = await self._rebuild()
                    ready.set()
                position, changes = await self.store.follow(position)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("semantic cache change log unreachable: %s", e)
                await asyncio.sleep(0.5)
                continue
            for change in changes:
                self._apply(change)
            SEMANTIC_CACHE_ENTRIES.set(len(self.index))

    def _apply(self, change: Change) -> None:
        if not change.added:
            self.index.remove(change.key)
        elif change.vector is not None and change.vector.any():
            self._add(change.fingerprint, change.key, change.vector)


def _error(e: Exception) -> bus_pb2.Error:
    bad = isinstance(e, ValueError)
    code = bus_pb2.ERROR_CODE_INVALID_ARGUMENT if bad else bus_pb2.ERROR_CODE_UNAVAILABLE
    return bus_pb2.Error(code=code, message=str(e))
