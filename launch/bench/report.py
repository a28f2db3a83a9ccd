"""The result: a table for the terminal and one JSON file (schema in docs/bench-serve.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launch.bench.client import RequestRecord

SCHEMA = "epd-bench-serve/2"
_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _cache_lines(summary: dict[str, Any]) -> list[str]:
    """Image repeats and the cache's answers against the expected ones, where measured."""
    lines = []
    for outcome, g in summary.get("by_cache", {}).items():
        lines.append(
            f"  {outcome:<13} {g['requests']:>4} req, TTFT p50 {_num(g['ttft_ms']['p50'])} ms, "
            f"E2E p50 {_num(g['e2el_ms']['p50'])} / p90 {_num(g['e2el_ms']['p90'])} ms"
        )
    if "images" in summary:
        img = summary["images"]
        lines.append(f"image slots: {img['slots']}, repeats {img['repeats']}")
    if "expected_cache" in summary:
        exp = summary["expected_cache"]
        for kind, k in exp["kinds"].items():
            lines.append(
                f"  {kind:<11} {k['requests']:>4} req, hits {k['hits']:>4} "
                f"(right: {k['expected_hits']:>4}), TTFT p50 {_num(k['ttft_p50_ms'])} ms, "
                f"E2E p50 {_num(k['e2el_p50_ms'])} ms"
            )
        lines.append(f"false hits {exp['false_hits']}, missed hits {exp['missed_hits']}")
    return lines


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """A plain-text table of the summary's figures."""
    rows = [
        ("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", _num(summary["duration_s"])),
        ("output tokens", str(summary["output_tokens"])),
        ("request throughput (req/s)", _num(summary["request_throughput"])),
        ("output throughput (tok/s)", _num(summary["output_throughput"])),
    ]
    if summary["slo_ms"]:
        slo = " ".join(f"{k}:{v:g}" for k, v in summary["slo_ms"].items())
        rows.append((f"goodput (req/s, {slo} ms)", _num(summary["goodput"])))
    lines = [f"{name:<36}{value:>14}" for name, value in rows]
    cols = ("mean", "p50", "p90", "p99")
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{c:>10}" for c in cols))
    for key, label in _LATENCIES:
        lines.append(f"{label:<14}" + "".join(f"{_num(summary[key][c]):>10}" for c in cols))
    for name, counts in (("errors", summary["errors"]), ("cache", summary["cache"])):
        if counts:
            lines.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines += _cache_lines(summary)
    width = max(len(line) for line in lines)
    bar = "=" * width
    head = f" epd bench serve {title} " if title else " epd bench serve "
    return "\n".join([bar, head.center(width, "="), *lines, bar])


def json_safe(obj: Any) -> Any:
    """NaN (an empty statistic) as null and an infinite rate as "inf": JSON has neither."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def result_document(
    config: dict[str, Any], summary: dict[str, Any], records: list[RequestRecord]
) -> dict[str, Any]:
    """The JSON result: schema tag, the run's settings, the summary, every request's record."""
    return json_safe(
        {
            "schema": SCHEMA,
            "config": config,
            "summary": summary,
            "requests": [asdict(r) for r in records],
        }
    )


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write the result document (indented, UTF-8)."""
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
