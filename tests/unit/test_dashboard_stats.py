"""The dashboard's rolling window (gateway/dashboard/stats.py) on a fake clock: requests
land in the right bucket, old buckets leave the window, percentiles interpolate,
cache outcomes and hit rate add up, samples per bucket stay bounded, and a closed
bucket's summary does not change."""

from __future__ import annotations

import pytest

from gateway.dashboard.stats import RollingStats, percentiles


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def ok(stats: RollingStats, ttft: float = 0.1, tpot: float = 0.01, cache: str = "miss") -> None:
    stats.observe(ttft_s=ttft, tpot_s=tpot, tokens=4, ok=True, cache=cache)


def test_percentiles_interpolate_like_the_benchmark_client():
    assert percentiles([]) is None
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    values = [float(v) for v in range(0, 101)]  # 0..100, shuffled order must not matter
    assert percentiles(values[::-1]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    got = percentiles([1.0, 2.0, 3.0, 4.0])  # between ranks: interpolated, not the nearest
    assert got == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})


def test_requests_land_in_their_bucket_and_the_window_is_dense():
    clock = Clock(1000.0)  # bucket 200 of 5 s
    stats = RollingStats(bucket_s=5, buckets=4, clock=clock)
    ok(stats)
    clock.t = 1006.0  # bucket 201
    ok(stats)
    ok(stats)
    stats.observe(ttft_s=None, tpot_s=None, tokens=0, ok=False, cache="miss")
    snap = stats.snapshot()
    assert [b["requests"] for b in snap["buckets"]] == [0, 0, 1, 3]
    assert snap["buckets"][-1]["errors"] == 1
    assert snap["buckets"][-1]["span_s"] == pytest.approx(1.0)  # the current bucket so far
    assert snap["buckets"][-2]["span_s"] == 5
    assert snap["totals"]["requests"] == 4 and snap["totals"]["errors"] == 1
    assert snap["totals"]["tokens"] == 12  # the failed one streamed none
    assert snap["buckets"][0]["ttft"] is None  # an empty bucket has no percentiles


def test_old_buckets_leave_the_window():
    clock = Clock(1000.0)
    stats = RollingStats(bucket_s=5, buckets=4, clock=clock)
    ok(stats, ttft=9.0)
    clock.t = 1000.0 + 5 * 3  # still inside: the oldest of 4 buckets
    assert stats.snapshot()["totals"]["requests"] == 1
    clock.t = 1000.0 + 5 * 4  # out of the window, even with no new request to push it out
    snap = stats.snapshot()
    assert snap["totals"]["requests"] == 0 and snap["totals"]["ttft"] is None
    ok(stats, ttft=0.2)
    assert stats.snapshot()["totals"]["ttft"]["p99"] == 0.2


def test_cache_outcomes_and_hit_rate():
    stats = RollingStats(clock=Clock())
    for outcome in ("hit-exact", "hit-exact", "hit-semantic", "miss"):
        ok(stats, cache=outcome)
    totals = stats.snapshot()["totals"]
    assert totals["cache"] == {"hit-exact": 2, "hit-semantic": 1, "miss": 1, "off": 0}
    assert totals["hit_rate"] == pytest.approx(0.75)
    off = RollingStats(clock=Clock())
    ok(off, cache="off")  # no response cache: no hit rate, rather than 0 %
    assert off.snapshot()["totals"]["hit_rate"] is None


def test_samples_per_bucket_are_bounded_and_spread():
    stats = RollingStats(max_samples=50, clock=Clock(), seed=1)
    for i in range(10_000):
        ok(stats, ttft=float(i))
    (bucket,) = stats._ring
    assert len(bucket.ttft) == 50 and bucket.seen_ttft == 10_000
    assert stats.snapshot()["totals"]["requests"] == 10_000  # counts are exact
    # A reservoir, not the first 50: its median is near the population's (5,000).
    assert 2_500 < stats.snapshot()["totals"]["ttft"]["p50"] < 7_500


def test_observe_run_computes_ttft_and_tpot_from_perf_counter_readings(monkeypatch):
    stats = RollingStats(clock=Clock())
    monkeypatch.setattr("gateway.dashboard.stats.time.perf_counter", lambda: 11.0)
    stats.observe_run(start=10.0, first_at=10.2, token_counts=[5, 9], ok=True, cache="miss")
    totals = stats.snapshot()["totals"]
    assert totals["ttft"]["p50"] == pytest.approx(0.2)
    assert totals["tpot"]["p50"] == pytest.approx(0.8 / 8)  # the longest choice: 9 tokens
    assert totals["tokens"] == 14
    stats.observe_run(start=10.0, first_at=None, token_counts=[0], ok=False, cache="miss")
    assert stats.snapshot()["totals"]["ttft"]["p50"] == pytest.approx(0.2)  # none added


def test_a_closed_bucket_summary_is_computed_once():
    clock = Clock(1000.0)
    stats = RollingStats(bucket_s=5, buckets=3, clock=clock)
    ok(stats, ttft=0.5)
    clock.t = 1005.0
    first = stats.snapshot()["buckets"][-2]
    assert stats.snapshot()["buckets"][-2] is first  # memoised, not re-sorted per poll
    assert first["ttft"]["p50"] == 0.5


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        RollingStats(bucket_s=0)
    with pytest.raises(ValueError):
        RollingStats(buckets=0)
