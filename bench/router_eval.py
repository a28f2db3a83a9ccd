"""The semantic router on a labelled set: routing accuracy, guard precision and recall,
and the router's own latency.

    python bench/router_eval.py                       # bench/data/router_eval.{jsonl,yaml}
    python bench/router_eval.py --config my.yaml --data my.jsonl --json out.json

Every request of the set (bench/data/router_eval.jsonl: routed requests labelled with
their route, PII and jailbreak positives, hard negatives of both) goes through
``SemanticRouter.decide`` with the config's routes and guards, embeddings from the real
MiniLM model in this process. The texts are embedded once up front, so the latency
figures are the router's added time on top of the embedding the cache service computes
(keyword, regex, feature, PII and jailbreak checks, similarity votes); the embedding's
own time (one text, one thread) is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _latency_stats import pct  # noqa: E402

from gateway.semantic_router.config import load_config  # noqa: E402
from gateway.semantic_router.router import GuardBlocked, SemanticRouter  # noqa: E402
from gateway.semantic_router.state import compile_state  # noqa: E402

DATA = ROOT / "bench" / "data"


class Precomputed:
    """Vectors computed up front (decisions then time only the router)."""

    def __init__(self, texts: list[str], vectors: np.ndarray):
        self.table = dict(zip(texts, vectors, strict=True))

    async def embed(self, texts: list[str], timeout_s: float) -> np.ndarray:
        return np.stack([self.table[t] for t in texts])


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def decide(router: SemanticRouter, row: dict) -> tuple[str | None, str, float, float]:
    """(route or None when blocked, the guard that acted or "", wall seconds, CPU seconds
    of this thread: on a shared machine the wall time includes other processes' turns)."""
    messages = [{"role": "user", "content": row["text"]}]
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        d = await router.decide("auto", messages, images=row["images"])
        route, guard = d.route, d.guard.guard if d.guard.action != "allow" else ""
    except GuardBlocked as e:
        route, guard = None, e.decision.guard.guard
    return route, guard, time.perf_counter() - t0, time.thread_time() - c0


def guard_scores(rows: list[dict], guards: list[str], name: str, label: str) -> dict:
    tp = sum(r[label] and g == name for r, g in zip(rows, guards, strict=True))
    fp = sum(not r[label] and g == name for r, g in zip(rows, guards, strict=True))
    fn = sum(r[label] and g != name for r, g in zip(rows, guards, strict=True))
    missed = [r["id"] for r, g in zip(rows, guards, strict=True) if r[label] and g != name]
    false = [r["id"] for r, g in zip(rows, guards, strict=True) if not r[label] and g == name]
    return {
        "precision": tp / max(tp + fp, 1),
        "recall": tp / max(tp + fn, 1),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "missed": missed,
        "false_positives": false,
    }


async def evaluate(config_path: Path, rows: list[dict], passes: int) -> dict:
    from cache_svc.embedder import SentenceEmbedder

    embedder = SentenceEmbedder()
    config = load_config(config_path)
    texts = sorted({r["text"] for r in rows})
    vectors = embedder(texts)
    pre = Precomputed(texts, vectors)
    prompts = [*(ex for r in config.routes for ex in r.examples)]
    from gateway.semantic_router.state import attack_prompts

    prompts += attack_prompts(config)
    pre.table.update(zip(prompts, embedder(prompts), strict=True))
    router = SemanticRouter(await compile_state(config, pre), pre)
    results = [await decide(router, r) for r in rows]
    timed = [await decide(router, r) for _ in range(passes) for r in rows]
    times = [(wall, cpu) for *_, wall, cpu in timed]
    embed_times = []
    for text in texts[:50]:
        t0 = time.perf_counter()
        embedder([text])
        embed_times.append(time.perf_counter() - t0)
    return report(rows, results, times, embed_times)


def report(
    rows: list[dict], results: list, times: list[tuple[float, float]], embed_times: list[float]
) -> dict:
    routed = [(r, res) for r, res in zip(rows, results, strict=True) if r["route"]]
    correct = sum(res[0] == r["route"] for r, res in routed)
    confusion = collections.Counter((r["route"], res[0]) for r, res in routed)
    guards = [res[1] for res in results]
    ms = [wall * 1e3 for wall, _ in times]
    cpu = [c * 1e3 for _, c in times]
    return {
        "requests": len(rows),
        "routed": len(routed),
        "routing_accuracy": correct / max(len(routed), 1),
        "per_route": {
            route: sum(res[0] == route for r, res in routed if r["route"] == route)
            / sum(r["route"] == route for r, _ in routed)
            for route in sorted({r["route"] for r, _ in routed})
        },
        "wrong": sorted(
            f"{r['id']}: {r['route']} -> {res[0]}" for r, res in routed if res[0] != r["route"]
        ),
        "confusion": {f"{a}->{b}": n for (a, b), n in sorted(confusion.items(), key=str)},
        "pii": guard_scores(rows, guards, "pii", "pii"),
        "jailbreak": guard_scores(rows, guards, "jailbreak", "jailbreak"),
        "router_ms": {"p50": pct(ms, 50), "p99": pct(ms, 99), "n": len(ms)},
        "router_cpu_ms": {"p50": pct(cpu, 50), "p99": pct(cpu, 99)},
        "embed_ms_one_text": {"p50": pct([t * 1e3 for t in embed_times], 50)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=DATA / "router_eval.yaml")
    ap.add_argument("--data", type=Path, default=DATA / "router_eval.jsonl")
    ap.add_argument("--passes", type=int, default=5, help="timed passes over the set")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as the cache service runs it
    out = asyncio.run(evaluate(args.config, load_rows(args.data), args.passes))
    print(
        f"requests {out['requests']}, routed {out['routed']}: "
        f"routing accuracy {out['routing_accuracy']:.3f}"
    )
    for route, acc in out["per_route"].items():
        print(f"  {route:<10} {acc:.3f}")
    for name in ("pii", "jailbreak"):
        g = out[name]
        print(
            f"{name:<10} precision {g['precision']:.3f} recall {g['recall']:.3f} "
            f"(tp {g['tp']}, fp {g['fp']}, fn {g['fn']})"
        )
    r = out["router_ms"]
    c = out["router_cpu_ms"]
    print(
        f"router added latency p50 {r['p50']:.3f} ms, p99 {r['p99']:.3f} ms wall; "
        f"p50 {c['p50']:.3f} ms, p99 {c['p99']:.3f} ms CPU ({r['n']} decisions); "
        f"embedding one text p50 {out['embed_ms_one_text']['p50']:.1f} ms"
    )
    if out["wrong"]:
        print("misrouted:", *out["wrong"], sep="\n  ")
    for name in ("pii", "jailbreak"):
        if out[name]["missed"] or out[name]["false_positives"]:
            print(
                f"{name} missed: {out[name]['missed']}; false positives: "
                f"{out[name]['false_positives']}"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
