"""Benchmark helper: percentiles and the latency table of the disaggregated benchmark."""

from __future__ import annotations

from services.stats import percentile as pct


def report_latency(
    res: dict, rounds: int, per_level: tuple[tuple[int, int], ...], max_tokens: int
) -> float:
    """Print the tables; return the TTFT p50 overhead (ms) at 1 stream, all prompts."""
    samples = res["samples"]
    print(f"\nLatency (ms), {rounds} rounds, max_tokens={max_tokens}, ignore_eos")
    print(
        f"{'streams':>7} {'prompts':>7} {'n':>4} | {'system':<7} {'TTFT p50':>9} {'TTFT p99':>9}"
        f" {'TPOT p50':>9} {'TPOT p99':>9} {'gap2 p50':>9} {'gap2 p99':>9}"
    )
    overhead_c1 = float("nan")
    for c, _ in per_level:
        for kind in ("text", "image", "all"):
            p50s = {
                name: _print_row(samples[(name, c)], c, kind, name) for name in ("disagg", "agg")
            }
            over = p50s["disagg"] - p50s["agg"]
            print(
                f"{'':>20}   TTFT p50 overhead {over:+.1f} ms ({p50s['disagg'] / p50s['agg']:.2f}x)"
            )
            if c == 1 and kind == "all":
                overhead_c1 = over
    print(f"greedy outputs that differ between the systems: {res['mismatches']}")
    return overhead_c1


def _print_row(samples: list, streams: int, kind: str, name: str) -> float:
    """Print one system's row for ``kind`` prompts ("all" for every kind); return TTFT p50."""
    sel = [x for x in samples if kind in ("all", x.kind)]
    ttft = [x.ttft_s * 1e3 for x in sel]
    tpot = [x.tpot_s * 1e3 for x in sel if x.tpot_s is not None]
    gap2 = [x.gap2_s * 1e3 for x in sel if x.gap2_s is not None]
    print(
        f"{streams:>7} {kind:>7} {len(sel):>4} | {name:<7} {pct(ttft, 50):9.1f} "
        f"{pct(ttft, 99):9.1f} {pct(tpot, 50):9.2f} {pct(tpot, 99):9.2f} "
        f"{pct(gap2, 50):9.1f} {pct(gap2, 99):9.1f}"
    )
    return pct(ttft, 50)
