"""EPD_CACHE_HEAD_START_MS: after an exact miss the full (semantic) lookup runs alone for
that long; a hit within it is the answer (the workers never start), past it the same
lookup goes on beside the workers, and nothing is left behind. The full lookup goes to
the replica that the exact miss's reply names (it is embedding the question)."""

from __future__ import annotations

import asyncio

import pytest

from cache_svc.config import SemanticCacheConfig
from gateway.cache_client import BusCacheClient, LocalCacheClient
from gateway.prepare import PreparedRequest
from gateway.response_cache import ResponseCache
from protos.epd_pb import bus_pb2
from services.sampling_params import SamplingParams


class ScriptedCache:
    """A CacheClient whose replies the test releases, kind by kind."""

    ask = False

    def ask_first(self) -> bool:
        return self.ask

    def __init__(self, exact_hit: bool, embedding_on: str = "") -> None:
        self.exact_hit, self.embedding_on = exact_hit, embedding_on
        self.sent: list[bool] = []  # exact_only of each query, in order
        self.replicas: list[str] = []  # the replica each query was sent to ("": any)
        self.release = {True: asyncio.Event(), False: asyncio.Event()}
        self.cancelled: list[bool] = []
        self.any_sent = asyncio.Event()

    async def lookup(self, query: bus_pb2.CacheQuery, timeout_s: float, replica: str = ""):
        self.sent.append(query.exact_only)
        self.replicas.append(replica)
        self.any_sent.set()
        try:
            await self.release[query.exact_only].wait()
        except asyncio.CancelledError:
            self.cancelled.append(query.exact_only)
            raise
        hit = self.exact_hit if query.exact_only else True
        tier = "exact" if query.exact_only else "semantic"
        answer = bus_pb2.CachedAnswer(max_tokens=8)
        answer.choices.add(index=0, token_ids=[5, 6])
        reply = bus_pb2.CacheLookupReply(hit=hit, tier=tier, similarity=0.9, answer=answer)
        if query.exact_only and not hit:
            reply.embedding_on = self.embedding_on
        return reply

    async def store(self, req, timeout_s: float):
        return bus_pb2.CacheStoreReply(stored=True)


def _setup(
    exact_hit: bool, embedding_on: str = ""
) -> tuple[ResponseCache, ScriptedCache, PreparedRequest]:
    client = ScriptedCache(exact_hit, embedding_on)
    cache = ResponseCache(client, SemanticCacheConfig(), "model-fp")
    prep = PreparedRequest(
        "req-1",
        [1, 2, 3],
        SamplingParams(temperature=0, max_tokens=8),
        messages=[{"role": "user", "content": "how tall is it?"}],
    )
    return cache, client, prep


def _head_start(exact_hit: bool, ms: float):
    cache, client, prep = _setup(exact_hit)
    cache.config = SemanticCacheConfig(cache_head_start_ms=ms)
    return cache, client, prep


async def test_a_semantic_hit_within_the_head_start_never_starts_the_workers():
    cache, client, prep = _head_start(exact_hit=False, ms=60_000)
    query = cache.query(prep)
    client.release[True].set()
    client.release[False].set()
    assert await cache.lookup(prep, query, exact_only=True) is None
    answer = await cache.head_start(prep, query)  # the caller starts no workers: it has it
    assert answer is not None and prep.cache_status == "hit-semantic" and not cache._early
    assert client.sent == [True, False]  # the full lookup only after the exact miss


async def test_past_the_head_start_the_lookup_goes_on_beside_the_workers():
    cache, client, prep = _head_start(exact_hit=False, ms=1)
    query = cache.query(prep)
    client.release[True].set()
    assert await cache.lookup(prep, query, exact_only=True) is None
    assert await cache.head_start(prep, query) is None  # the full lookup is still held back
    client.release[False].set()
    answer = await cache.lookup(prep, query, exact_only=False)  # the same one, not a new one
    assert answer is not None and client.sent == [True, False] and not cache._early


async def test_a_caller_that_gives_up_leaves_nothing_behind():
    cache, client, prep = _head_start(exact_hit=False, ms=60_000)
    waiting = asyncio.ensure_future(cache.head_start(prep, cache.query(prep)))
    await client.any_sent.wait()  # the full lookup is out, held by the test
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0)  # one loop turn: the cancellation reaches the full lookup
    assert client.cancelled == [False] and not cache._early


def test_auto_asks_first_only_when_the_client_says_so():
    cache, client, _ = _setup(exact_hit=False)
    assert cache.config.cache_head_start_ms is None and cache.head_start_s() == 0.0
    client.ask = True
    assert cache.head_start_s() == cache.config.cache_lookup_timeout_ms / 1e3
    cache.config = SemanticCacheConfig(cache_head_start_ms=20)
    assert cache.head_start_s() == 0.02  # set: whatever the client


def test_the_head_start_reads_auto_and_numbers_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_CACHE_HEAD_START_MS", "auto")
    assert SemanticCacheConfig.from_env().cache_head_start_ms is None
    monkeypatch.setenv("EPD_CACHE_HEAD_START_MS", "15")
    assert SemanticCacheConfig.from_env().cache_head_start_ms == 15.0
    with pytest.raises(ValueError, match="cache_head_start_ms"):
        SemanticCacheConfig(cache_head_start_ms=-1)


def test_an_in_process_cache_asks_first_while_its_engine_is_idle():
    busy = [False]
    local = LocalCacheClient(object(), lambda: busy[0])
    assert local.ask_first()
    busy[0] = True
    assert not local.ask_first()
    assert not BusCacheClient(bus=None).ask_first()


async def test_no_head_start_by_default_before_a_cache_service():
    cache, client, prep = _setup(exact_hit=False)
    client.release[True].set()
    query = cache.query(prep)
    assert await cache.lookup(prep, query, exact_only=True) is None
    assert await cache.head_start(prep, query) is None
    assert client.sent == [True] and not cache._early  # the full lookup waits for the caller


@pytest.mark.parametrize("head_start_ms", [0, 60_000])
async def test_the_full_lookup_goes_to_the_replica_embedding_the_question(head_start_ms):
    cache, client, prep = _setup(exact_hit=False, embedding_on="cache-7")
    cache.config = SemanticCacheConfig(cache_head_start_ms=head_start_ms)
    client.release[True].set()
    client.release[False].set()
    query = cache.query(prep)
    assert await cache.lookup(prep, query, exact_only=True) is None
    answer = await cache.head_start(prep, query) or await cache.lookup(prep, query, False)
    assert answer is not None and client.replicas == ["", "cache-7"]


@pytest.mark.parametrize("name", ["", "cache.7", "cache *", "x" * 129])
async def test_a_replica_name_that_is_no_subject_token_is_ignored(name):
    cache, client, prep = _setup(exact_hit=False, embedding_on=name)
    client.release[True].set()
    client.release[False].set()
    query = cache.query(prep)
    assert await cache.lookup(prep, query, exact_only=True) is None
    assert await cache.lookup(prep, query, exact_only=False) is not None
    assert client.replicas == ["", ""] and prep.cache_replica == ""


def test_an_output_constraint_keys_the_answer():
    cache, _, _ = _setup(False)

    def fingerprint(constraint) -> str:
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint)
        prep = PreparedRequest("r", [1, 2, 3], params, messages=[{"role": "user", "content": "q"}])
        return cache.query(prep).fingerprint

    plain, schema = fingerprint(None), fingerprint({"json": {"type": "object"}})
    assert len({plain, schema, fingerprint({"choice": ["a", "b"]})}) == 3
    assert schema == fingerprint({"json": {"type": "object"}})
