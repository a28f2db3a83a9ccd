"""A set of ids that forgets them after a while (late messages for aborted requests)."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentIds:
    def __init__(self, ttl_s: float, max_size: int = 100_000):
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> None:
        self._ids[key] = time.monotonic()
        self._ids.move_to_end(key)
        self._expire()

    def __contains__(self, key: str) -> bool:
        self._expire()
        return key in self._ids

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._ids and (
            len(self._ids) > self.max_size or next(iter(self._ids.values())) < cutoff
        ):
            self._ids.popitem(last=False)
