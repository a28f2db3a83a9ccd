"""The result: a table for the terminal and one JSON file (schema in docs/bench-serve.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.bench.client import RequestRecord

SCHEMA = "epd-bench-serve/1"
_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(summary: dict[str, Any]) -> str:
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
    for title, counts in (("errors", summary["errors"]), ("cache", summary["cache"])):
        if counts:
            lines.append(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    width = max(len(line) for line in lines)
    bar = "=" * width
    return "\n".join([bar, " epd bench serve ".center(width, "="), *lines, bar])


def _finite(obj: Any) -> Any:
    """NaN (an empty statistic) as null: JSON has no NaN."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def result_document(config: dict[str, Any], summary: dict[str, Any],
                    records: list[RequestRecord]) -> dict[str, Any]:  # fmt: skip
    """The JSON result: schema tag, the run's settings, the summary, every request's record."""
    return _finite({"schema": SCHEMA, "config": config, "summary": summary,
                    "requests": [asdict(r) for r in records]})  # fmt: skip


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write the result document (indented, UTF-8)."""
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
