"""This gateway's last few minutes, for the dashboard: requests, TTFT, TPOT and cache
outcomes in fixed time buckets (default 60 x 5 s).

Fed once per finished request from ``GatewayCore.run`` on the event loop, so ``observe``
is O(1); percentiles are computed when the page asks, and a closed bucket's summary is
computed once. Samples per bucket are bounded (reservoir sampling): memory does not
grow with the request rate. Prometheus (services/metrics.py) keeps the long history.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.stats import percentile

# The cache outcomes a request can have here ("off": this gateway has no response cache).
CACHE_OUTCOMES = ("hit-exact", "hit-semantic", "miss", "off")
PERCENTILES = (50, 90, 99)


@dataclass
class _Bucket:
    index: int  # floor(clock / bucket_s)
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    seen_ttft: int = 0  # samples offered, kept or not (reservoir sampling)
    seen_tpot: int = 0
    cache: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_OUTCOMES, 0))


def percentiles(samples: Sequence[float]) -> dict[str, float] | None:
    """p50/p90/p99 of ``samples`` (None when there are none)."""
    if not samples:
        return None
    return {f"p{p}": percentile(samples, p) for p in PERCENTILES}


class RollingStats:
    """Request outcomes over the last ``buckets * bucket_s`` seconds."""

    # max_samples: 128 per bucket keeps a poll at ~2 ms of the event loop when every bucket
    # is full (60 x 128 samples sorted per metric); 512 cost ~70 ms.
    def __init__(
        self,
        bucket_s: float = 5.0,
        buckets: int = 60,
        max_samples: int = 128,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ):
        if bucket_s <= 0 or buckets < 1 or max_samples < 1:
            raise ValueError("bucket_s > 0, buckets >= 1 and max_samples >= 1 are required")
        self.bucket_s, self.buckets, self.max_samples = bucket_s, buckets, max_samples
        self._clock = clock
        self._rng = random.Random(seed)
        self._ring: deque[_Bucket] = deque()
        self._closed: dict[int, dict] = {}  # summaries of buckets that take no more samples

    def observe(
        self, *, ttft_s: float | None, tpot_s: float | None, tokens: int, ok: bool, cache: str
    ) -> None:
        """One finished request: its time to first token and per output token (None when
        it has no such time), the tokens it streamed, whether it completed, and its cache
        outcome (one of CACHE_OUTCOMES)."""
        b = self._current()
        b.requests += 1
        b.errors += not ok
        b.tokens += tokens
        if cache in b.cache:
            b.cache[cache] += 1
        if ttft_s is not None:
            b.seen_ttft += 1
            self._keep(b.ttft, b.seen_ttft, ttft_s)
        if tpot_s is not None:
            b.seen_tpot += 1
            self._keep(b.tpot, b.seen_tpot, tpot_s)

    def observe_run(
        self,
        start: float,
        first_at: float | None,
        token_counts: Sequence[int],
        ok: bool,
        cache: str,
    ) -> None:
        """``observe`` from a request's ``time.perf_counter()`` readings (its start, its
        first token's) and its choices' token counts; TPOT is that of its longest choice."""
        end = time.perf_counter()
        longest = max(token_counts, default=0)
        ttft = first_at - start if first_at is not None else None
        tpot = (end - first_at) / (longest - 1) if first_at is not None and longest > 1 else None
        self.observe(ttft_s=ttft, tpot_s=tpot, tokens=sum(token_counts), ok=ok, cache=cache)

    def snapshot(self) -> dict:
        """Every bucket of the window, oldest first (empty ones included, so the charts'
        x axis is time), and the totals over the window."""
        now = self._clock()
        current = math.floor(now / self.bucket_s)
        self._expire(current)
        by_index = {b.index: b for b in self._ring}
        rows = []
        for index in range(current - self.buckets + 1, current + 1):
            b = by_index.get(index) or _Bucket(index)
            span = now - index * self.bucket_s if index == current else self.bucket_s
            rows.append(self._summary(b, closed=index != current, span_s=max(span, 1e-3)))
        return {
            "bucket_s": self.bucket_s,
            "window_s": self.bucket_s * self.buckets,
            "buckets": rows,
            "totals": self._totals(rows),
        }

    def _current(self) -> _Bucket:
        index = math.floor(self._clock() / self.bucket_s)
        if not self._ring or self._ring[-1].index != index:
            self._ring.append(_Bucket(index))
            self._expire(index)
        return self._ring[-1]

    def _expire(self, current: int) -> None:
        while self._ring and self._ring[0].index <= current - self.buckets:
            self._closed.pop(self._ring.popleft().index, None)

    def _keep(self, kept: list[float], seen: int, value: float) -> None:
        """Reservoir sampling: every sample offered stays with equal probability."""
        if len(kept) < self.max_samples:
            kept.append(value)
            return
        slot = self._rng.randrange(seen)
        if slot < self.max_samples:
            kept[slot] = value

    def _summary(self, b: _Bucket, closed: bool, span_s: float) -> dict:
        if closed and b.index in self._closed:
            return self._closed[b.index]
        row = {
            "requests": b.requests,
            "errors": b.errors,
            "tokens": b.tokens,
            "span_s": span_s,
            "ttft": percentiles(b.ttft),
            "tpot": percentiles(b.tpot),
            "cache": dict(b.cache),
        }
        if closed and b.requests:
            self._closed[b.index] = row
        return row

    def _totals(self, rows: list[dict]) -> dict:
        cache = dict.fromkeys(CACHE_OUTCOMES, 0)
        for row in rows:
            for k, v in row["cache"].items():
                cache[k] += v
        # Pooled reservoirs: exact until a bucket holds more than max_samples.
        ttft = [x for b in self._ring for x in b.ttft]
        tpot = [x for b in self._ring for x in b.tpot]
        looked_up = cache["hit-exact"] + cache["hit-semantic"] + cache["miss"]
        return {
            "requests": sum(r["requests"] for r in rows),
            "errors": sum(r["errors"] for r in rows),
            "tokens": sum(r["tokens"] for r in rows),
            "ttft": percentiles(ttft),
            "tpot": percentiles(tpot),
            "cache": cache,
            "hit_rate": (looked_up - cache["miss"]) / looked_up if looked_up else None,
        }
