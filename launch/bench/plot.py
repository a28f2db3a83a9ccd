"""``--plot DIR``: PNG charts of a result document (matplotlib, the ``bench`` extra).

- ``latency_vs_rate.png``: TTFT, TPOT and E2E p50 / p90 / p99 against the request rate
  (one panel per figure; an infinite rate is drawn at the right edge, labelled "inf").
- ``throughput_vs_concurrency.png``: output and request throughput against the
  concurrency cap (runs without a cap are left out).

A single run draws single points; a sweep draws lines (one colour per cap in the latency
chart, solid p50, dashed p90, dotted p99; one line per rate in the throughput chart).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E"))
_QUANTILES = (("p50", "-"), ("p90", "--"), ("p99", ":"))


def _rate(x: Any) -> float:
    return math.inf if x in ("inf", None) else float(x)


def _runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's runs; a single run's document is one run of its config's settings."""
    if "runs" in doc:
        return doc["runs"]
    cfg = doc["config"]
    return [
        {
            "request_rate": cfg.get("request_rate"),
            "max_concurrency": cfg.get("max_concurrency"),
            "summary": doc["summary"],
        }
    ]


def _x_positions(rates: list[float]) -> tuple[dict[float, float], list[str]]:
    """Finite rates at themselves; inf one step past the largest finite rate."""
    finite = sorted({r for r in rates if not math.isinf(r)})
    pos = {r: r for r in finite}
    if any(math.isinf(r) for r in rates):
        pos[math.inf] = (finite[-1] * 1.5) if finite else 1.0
    labels = [f"{r:g}" if not math.isinf(r) else "inf" for r in sorted(pos)]
    return pos, labels


def latency_chart(runs: list[dict[str, Any]], path: Path) -> Path:
    """Latency percentiles against request rate, one line per concurrency cap."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    pos, labels = _x_positions([_rate(r["request_rate"]) for r in runs])
    caps = sorted({r["max_concurrency"] or 0 for r in runs})
    fig, axes = plt.subplots(1, len(_LATENCIES), figsize=(5 * len(_LATENCIES), 4))
    for ax, (key, name) in zip(axes, _LATENCIES, strict=True):
        for color, cap in enumerate(caps):
            group = sorted(
                (r for r in runs if (r["max_concurrency"] or 0) == cap),
                key=lambda r: _rate(r["request_rate"]),
            )
            xs = [pos[_rate(r["request_rate"])] for r in group]
            for q, style in _QUANTILES:
                ys = [(r["summary"][key] or {}).get(q) for r in group]
                ys = [math.nan if y is None else y for y in ys]
                cap_label = f", cap {cap}" if len(caps) > 1 else ""
                ax.plot(xs, ys, style, color=f"C{color}", marker="o", label=f"{q}{cap_label}")
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(sorted(pos.values()), labels)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_chart(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Output and request throughput against the concurrency cap, one line per rate."""
    capped = [r for r in runs if r["max_concurrency"]]
    if not capped:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (out_ax, req_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for rate in sorted({_rate(r["request_rate"]) for r in capped}):
        group = sorted(
            (r for r in capped if _rate(r["request_rate"]) == rate),
            key=lambda r: r["max_concurrency"],
        )
        xs = [r["max_concurrency"] for r in group]
        label = f"rate {rate:g}" if not math.isinf(rate) else "rate inf"
        out_ax.plot(xs, [r["summary"]["output_throughput"] for r in group], marker="o", label=label)
        req_ax.plot(
            xs, [r["summary"]["request_throughput"] for r in group], marker="o", label=label
        )
    for ax, name in ((out_ax, "output throughput (tok/s)"), (req_ax, "request throughput (req/s)")):
        ax.set_title(name)
        ax.set_xlabel("max concurrency")
        caps = sorted({r["max_concurrency"] for r in capped})
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [str(c) for c in caps])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_runs(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the charts for ``doc`` into ``out_dir``; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = _runs(doc)
    written = [latency_chart(runs, out / "latency_vs_rate.png")]
    tp = throughput_chart(runs, out / "throughput_vs_concurrency.png")
    return written + ([tp] if tp else [])
