"""The gateway's ways to reach the semantic cache: over the bus (``BusCacheClient``, any
replica of the cache service) or in this process (``LocalCacheClient``, ``epd serve
all``), behind one ``CacheClient`` protocol that ``ResponseCache`` (response_cache.py)
uses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.connection import Bus
from services.bus.errors import NoResponders


class CacheClient(Protocol):
    def ask_first(self) -> bool:
        """The "auto" head start: whether the lookup should run alone before the workers
        start (the cache shares the cores of an engine with nothing else to do)."""
        ...

    async def lookup(
        self, query: bus_pb2.CacheQuery, timeout_s: float, replica: str = ""
    ) -> bus_pb2.CacheLookupReply: ...
    async def store(
        self, req: bus_pb2.CacheStoreRequest, timeout_s: float
    ) -> bus_pb2.CacheStoreReply: ...


class BusCacheClient:
    """The cache service over NATS (any replica of the queue group).

    After "no responders" it stops asking for ``absent_s``: a fleet run without a cache
    service must not pay the bus's no-responders grace (a retry window of ~100 ms, for
    instances that are just subscribing) on every request's first token.
    """

    def __init__(self, bus: Bus, absent_s: float = 2.0, clock=time.monotonic):
        self.bus, self.absent_s, self.clock = bus, absent_s, clock
        self._absent_until = 0.0

    def ask_first(self) -> bool:
        return False  # the service has cores of its own: race

    async def lookup(self, query, timeout_s, replica=""):
        """``replica``: the instance to ask (it is embedding the query's text), any other
        one when it is gone."""
        if replica:
            deadline = self.clock() + timeout_s
            try:
                return await self.bus.request(
                    subjects.cache_lookup_at(replica), query, bus_pb2.CacheLookupReply, timeout_s
                )
            except NoResponders:
                timeout_s = max(deadline - self.clock(), 0.001)
        return await self._ask(subjects.CACHE_LOOKUP, query, bus_pb2.CacheLookupReply, timeout_s)

    async def store(self, req, timeout_s):
        return await self._ask(subjects.CACHE_STORE, req, bus_pb2.CacheStoreReply, timeout_s)

    async def _ask(self, subject, msg, reply_type, timeout_s):
        if self.clock() < self._absent_until:
            raise NoResponders(subject)
        try:
            return await self.bus.request(subject, msg, reply_type, timeout_s)
        except NoResponders:
            self._absent_until = self.clock() + self.absent_s
            raise


class LocalCacheClient:
    """A SemanticCache in this process (``epd serve all``); ``engine_busy``: whether the
    engine beside it has requests running or waiting."""

    def __init__(self, cache, engine_busy: Callable[[], bool]):
        self.cache, self.engine_busy = cache, engine_busy

    def ask_first(self) -> bool:
        # Started beside the lookup, the workers of an idle engine take the core from it
        # (a hit took ~1.4x as long) while a miss waits for the lookup anyway; a busy
        # engine steps for its other requests regardless, and racing costs it little.
        return not self.engine_busy()

    async def lookup(self, query, timeout_s, replica=""):
        return await asyncio.wait_for(self.cache.lookup(query), timeout_s)

    async def store(self, req, timeout_s):
        return await asyncio.wait_for(self.cache.put(req), timeout_s)
