"""One measured run of ``serving_peers.py`` through ``epd bench serve``'s own library, and
the comparison table built from many.

A run is ``epd bench serve`` with the same flags a user would type (parsed by its own
parser, so every dataset and option it has is available), against one system's base URL.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from _peers_cases import Case

from launch.bench.cli import add_bench_parser, bench_serve


def bench_args(
    base_url: str, model: str, flags: tuple[str, ...], seed: int, run: str
) -> argparse.Namespace:
    """``epd bench serve`` flags parsed by its own parser (defaults and checks included);
    ``{run}`` in a flag becomes ``run`` (a name unique to this run)."""
    parser = argparse.ArgumentParser(prog="epd")
    add_bench_parser(parser.add_subparsers(dest="command"))
    argv = [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--model",
        model,
        "--seed",
        str(seed),
        "--no-progress",
        *(f.replace("{run}", run) for f in flags),
    ]
    return parser.parse_args(argv)


async def run_case(
    base_url: str, model: str, case: Case, seed: int, run: str = ""
) -> dict[str, Any]:
    """Run ``case`` against one server; the result document of ``epd bench serve``."""
    return await bench_serve(bench_args(base_url, model, case.flags, seed, run or str(seed)))


FIGURES = (  # (key in the row, label, better when higher)
    ("output_throughput", "out tok/s", True),
    ("ttft_p50", "TTFT p50 ms", False),
    ("tpot_p50", "TPOT p50 ms", False),
    ("e2el_p50", "E2E p50 ms", False),
    ("goodput", "goodput req/s", True),
)


def row_of(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison table shows, from one run's summary."""
    nan = math.nan
    return {
        "output_throughput": summary["output_throughput"],
        "ttft_p50": (summary["ttft_ms"] or {}).get("p50") or nan,
        "tpot_p50": (summary["tpot_ms"] or {}).get("p50") or nan,
        "e2el_p50": (summary["e2el_ms"] or {}).get("p50") or nan,
        "goodput": summary["goodput"] if summary["goodput"] is not None else nan,
        "failed": summary["failed"],
        "cache": summary["cache"],
    }


def median_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per figure, the median over rounds (NaN-free values only)."""
    out = {}
    for key, _, _ in FIGURES:
        vals = [r[key] for r in rows if r[key] is not None and not math.isnan(r[key])]
        out[key] = statistics.median(vals) if vals else math.nan
    out["failed"] = sum(r["failed"] for r in rows)
    return out


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def table(case: Case, medians: dict[str, dict[str, float]], reference: str) -> str:
    """A case's figures per system (medians over rounds) and each peer's ratio to
    ``reference``: higher-is-better figures as ours / theirs, latencies as theirs / ours,
    so a ratio above 1 always means ``reference`` is better."""
    lines = [f"## {case.label}   ({' '.join(case.flags)})"]
    lines.append(
        f"{'system':<20}" + "".join(f"{lab:>15}" for _, lab, _ in FIGURES) + f"{'failed':>8}"
    )
    for name, m in medians.items():
        lines.append(
            f"{name:<20}"
            + "".join(f"{_fmt(m[k]):>15}" for k, _, _ in FIGURES)
            + f"{m['failed']:>8}"
        )
    ref = medians.get(reference)
    for name, m in medians.items():
        if ref is None or name == reference:
            continue
        ratios = [ratio(ref[k], m[k], hib) for k, _, hib in FIGURES]
        lines.append(
            f"{reference + '/' + name:<20}" + "".join(f"{_fmt_ratio(r):>15}" for r in ratios)
        )
    return "\n".join(lines)


def ratio(ours: float, theirs: float, higher_is_better: bool) -> float:
    """How many times better ``ours`` is (NaN when either is missing or zero)."""
    if math.isnan(ours) or math.isnan(theirs) or ours == 0 or theirs == 0:
        return math.nan
    return ours / theirs if higher_is_better else theirs / ours


def _fmt_ratio(r: float) -> str:
    return "-" if math.isnan(r) else f"{r:.2f}x"


async def greedy_words(base_url: str, model: str, prompt_ids: list[int], n: int) -> list[str]:
    """The words of a non-streamed greedy completion of ``prompt_ids`` (``n`` tokens): each
    token of the shared vocabulary decodes to one word, whatever the server's detokenizer."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": False,
    }
    async with httpx.AsyncClient(timeout=120.0) as client:
        resp = await client.post(base_url.rstrip("/") + "/completions", json=body)
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"].split()
