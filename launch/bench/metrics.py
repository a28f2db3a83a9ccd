"""Latency figures from request records: percentiles, throughput, goodput, errors, cache."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from launch.bench.client import RequestRecord
from services.stats import percentile

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of values in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def ttft_s(rec: RequestRecord) -> float:
    """Time to first token."""
    assert rec.first_token_s is not None
    return rec.first_token_s - rec.send_s


def tpot_s(rec: RequestRecord) -> float:
    """Time per output token after the first: (last - first) / (tokens - 1); 0 for one token."""
    if rec.output_tokens < 2:
        return 0.0
    return (rec.chunk_s[-1] - rec.chunk_s[0]) / (rec.output_tokens - 1)


def itl_s(rec: RequestRecord) -> list[float]:
    """Gaps between successive token-carrying chunks."""
    return [b - a for a, b in zip(rec.chunk_s, rec.chunk_s[1:], strict=False)]


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput wants KEY:MS with KEY in {SLO_KEYS}, got {spec!r}")
        slo[key] = float(value)
        if slo[key] <= 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {value}")
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """True when a completed request is within every SLO (milliseconds)."""
    got = {"ttft": ttft_s(rec), "tpot": tpot_s(rec), "e2el": rec.end_s - rec.send_s}
    return all(got[k] * 1000.0 <= limit for k, limit in slo.items())


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """The run's figures (schema in docs/bench-serve.md)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "ttft_ms": stats_ms([ttft_s(r) for r in ok]),
        "tpot_ms": stats_ms([tpot_s(r) for r in ok if r.output_tokens > 1]),
        "itl_ms": stats_ms([g for r in ok for g in itl_s(r)]),
        "e2el_ms": stats_ms([r.end_s - r.send_s for r in ok]),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "cache": dict(Counter(r.cache for r in records if r.cache is not None)),
        "goodput": None,
        "slo_ms": slo or {},
    }
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        summary["goodput"] = good / duration_s if duration_s > 0 else math.nan
    if summary["cache"]:
        summary["by_cache"] = by_cache(ok)
    if any(r.images for r in records):
        summary["images"] = {
            "slots": sum(r.images for r in records),
            "repeats": sum(r.image_repeats for r in records),
        }
    if any(r.expect for r in records):
        summary["expected_cache"] = expected_cache(records)
    return summary


def by_cache(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT and E2E of completed requests per ``x-epd-cache`` answer (what a hit costs)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in done:
        groups.setdefault(r.cache or "none", []).append(r)
    return {
        k: {
            "requests": len(g),
            "ttft_ms": stats_ms([ttft_s(r) for r in g]),
            "e2el_ms": stats_ms([r.end_s - r.send_s for r in g]),
        }
        for k, g in sorted(groups.items())
    }


def _hit(rec: RequestRecord) -> bool:
    return (rec.cache or "").startswith("hit")


def expected_cache(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Cache answers against what a right cache gives (completed requests with an ``expect``).

    Per kind (``negative/<why>`` grouped as ``negative``): requests, hits, expected hits and
    the TTFT / E2E p50. ``false_hits``: hits where a miss was right (a hard negative answered
    from the cache); ``missed_hits``: misses where a hit was right.
    """
    done = [r for r in records if r.ok and r.expect is not None]
    by_kind: dict[str, list[RequestRecord]] = {}
    for r in done:
        by_kind.setdefault((r.kind or "?").split("/")[0], []).append(r)
    kinds = {}
    for kind, group in sorted(by_kind.items()):
        kinds[kind] = {
            "requests": len(group),
            "hits": sum(map(_hit, group)),
            "expected_hits": sum(r.expect == "hit" for r in group),
            "ttft_p50_ms": percentile([ttft_s(r) * 1000 for r in group], 50),
            "e2el_p50_ms": percentile([(r.end_s - r.send_s) * 1000 for r in group], 50),
        }
    false_hits = [r for r in done if _hit(r) and r.expect == "miss"]
    return {
        "kinds": kinds,
        "false_hits": len(false_hits),
        "false_hits_by_kind": dict(Counter(r.kind for r in false_hits)),
        "missed_hits": sum(1 for r in done if not _hit(r) and r.expect == "hit"),
    }
