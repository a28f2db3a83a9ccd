"""The gateway sends the full (semantic) lookup together with the exact-only one: an exact
miss finds it already under way (one bus round trip sooner), an exact hit or a caller that
gives up cancels it, and nothing is left behind."""

from __future__ import annotations

import asyncio

from cache_svc.config import SemanticCacheConfig
from gateway.prepare import PreparedRequest
from gateway.response_cache import ResponseCache
from protos.epd_pb import bus_pb2
from services.sampling_params import SamplingParams


class ScriptedCache:
    """A CacheClient whose replies the test releases, kind by kind."""

    def __init__(self, exact_hit: bool) -> None:
        self.exact_hit = exact_hit
        self.sent: list[bool] = []  # exact_only of each query, in order
        self.release = {True: asyncio.Event(), False: asyncio.Event()}
        self.cancelled: list[bool] = []
        self.both_sent = asyncio.Event()

    async def lookup(self, query: bus_pb2.CacheQuery, timeout_s: float):
        self.sent.append(query.exact_only)
        if len(self.sent) == 2:
            self.both_sent.set()
        try:
            await self.release[query.exact_only].wait()
        except asyncio.CancelledError:
            self.cancelled.append(query.exact_only)
            raise
        hit = self.exact_hit if query.exact_only else True
        tier = "exact" if query.exact_only else "semantic"
        answer = bus_pb2.CachedAnswer(max_tokens=8)
        answer.choices.add(index=0, token_ids=[5, 6])
        return bus_pb2.CacheLookupReply(hit=hit, tier=tier, similarity=0.9, answer=answer)

    async def store(self, req, timeout_s: float):
        return bus_pb2.CacheStoreReply(stored=True)


def _setup(exact_hit: bool) -> tuple[ResponseCache, ScriptedCache, PreparedRequest]:
    client = ScriptedCache(exact_hit)
    cache = ResponseCache(client, SemanticCacheConfig(), "model-fp")
    prep = PreparedRequest("req-1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8),
                           messages=[{"role": "user", "content": "how tall is it?"}])  # fmt: skip
    return cache, client, prep


async def test_an_exact_miss_finds_the_full_lookup_already_sent():
    cache, client, prep = _setup(exact_hit=False)
    query = cache.query(prep)
    exact = asyncio.ensure_future(cache.lookup(prep, query, exact_only=True))
    await client.both_sent.wait()  # the full lookup went out before the exact one answered
    assert client.sent == [True, False]
    client.release[True].set()
    assert await exact is None and prep.cache_status == "miss"
    client.release[False].set()
    answer = await cache.lookup(prep, query, exact_only=False)
    assert list(answer.choices[0].token_ids) == [5, 6] and prep.cache_status == "hit-semantic"
    assert client.sent == [True, False] and not cache._early  # not asked twice


async def test_an_exact_hit_cancels_the_full_lookup():
    cache, client, prep = _setup(exact_hit=True)
    exact = asyncio.ensure_future(cache.lookup(prep, cache.query(prep), exact_only=True))
    await client.both_sent.wait()
    client.release[True].set()
    answer = await exact
    await asyncio.sleep(0)  # one loop turn: the cancellation reaches the full lookup
    assert answer is not None and prep.cache_status == "hit-exact"
    assert client.cancelled == [False] and not cache._early


async def test_a_caller_that_gives_up_leaves_nothing_behind():
    cache, client, prep = _setup(exact_hit=False)
    exact = asyncio.ensure_future(cache.lookup(prep, cache.query(prep), exact_only=True))
    await client.both_sent.wait()
    exact.cancel()
    await asyncio.gather(exact, return_exceptions=True)
    await asyncio.sleep(0)  # one loop turn: the cancellation reaches the full lookup
    assert sorted(client.cancelled) == [False, True] and not cache._early


def _head_start(exact_hit: bool, ms: float):
    cache, client, prep = _setup(exact_hit)
    cache.config = SemanticCacheConfig(cache_head_start_ms=ms)
    return cache, client, prep


async def test_a_semantic_hit_within_the_head_start_never_starts_the_workers():
    cache, client, prep = _head_start(exact_hit=False, ms=60_000)
    client.release[True].set()
    client.release[False].set()
    assert await cache.lookup(prep, cache.query(prep), exact_only=True) is None
    answer = await cache.head_start(prep)  # the caller starts no workers: it has the answer
    assert answer is not None and prep.cache_status == "hit-semantic" and not cache._early


async def test_past_the_head_start_the_lookup_goes_on_beside_the_workers():
    cache, client, prep = _head_start(exact_hit=False, ms=1)
    query = cache.query(prep)
    client.release[True].set()
    assert await cache.lookup(prep, query, exact_only=True) is None
    assert await cache.head_start(prep) is None  # the full lookup is still held back
    client.release[False].set()
    answer = await cache.lookup(prep, query, exact_only=False)  # the same one, not a new one
    assert answer is not None and client.sent == [True, False] and not cache._early


async def test_no_head_start_by_default():
    cache, client, prep = _setup(exact_hit=False)
    client.release[True].set()
    assert await cache.lookup(prep, cache.query(prep), exact_only=True) is None
    assert await cache.head_start(prep) is None and id(prep) in cache._early
    cache._drop_early(prep)
