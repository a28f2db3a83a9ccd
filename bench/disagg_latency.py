"""Disaggregated (E/P/D over NATS) against aggregated (``serve all``) on the demo model.

    python bench/disagg_latency.py            # full run, about 3 minutes
    python bench/disagg_latency.py --quick    # smoke run, about 1 minute

Everything runs on 127.0.0.1: private NATS and Redis, then as processes the fleet
(encoder, prefill, 1 decode, gateway) and one ``serve all`` gateway on another port.

- Latency: each round sends the same fresh request set to both systems, alternating which
  goes first; the idle system waits. Requests are chat prompts, half text-only and half
  with one new 64x64 PNG (so neither the embedding cache nor the prefix cache helps),
  ``temperature=0, max_tokens=32, ignore_eos``, at 1 and 4 concurrent streams. TTFT =
  request sent -> first response with tokens; TPOT = (last - first token time) / (n - 1),
  both on the client; gap2 = first -> second token (the KV hand-off when disaggregated).
  Goal: TTFT p50 overhead (disaggregated - aggregated) <= 10 ms.
- KV transfer: in this process, ``send_chunked`` to a ``ChunkReceiver`` (its own NATS
  connection, the decode service's window) against raw NATS publish of the same bytes as
  max_payload-sized messages to a counting subscriber, interleaved; median MB/s
  (MB = 1e6 bytes) per size. Goal: chunked >= 50 % of raw.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from _kv_transfer import KIB, MIB, measure_kv, report_kv  # noqa: E402
from _latency_requests import MAX_TOKENS  # noqa: E402
from _latency_run import latency  # noqa: E402
from _latency_stats import report_latency  # noqa: E402
from _stack import Fleet  # noqa: E402


@dataclass
class Sizes:
    """Workload sizes; ``--quick`` shrinks all of them."""

    rounds: int = 20
    warmup: int = 6  # requests per system and concurrency level before timing
    per_level: tuple[tuple[int, int], ...] = ((1, 8), (4, 16))  # (streams, requests) per round
    kv_sizes: tuple[int, ...] = (64 * KIB, 1 * MIB, 8 * MIB, 32 * MIB)
    kv_bytes_per_size: int = 256 * MIB  # bytes moved per size and method (>= 3 reps)


QUICK = Sizes(rounds=2, warmup=2, per_level=((1, 4), (4, 8)), kv_bytes_per_size=32 * MIB)


def demo_kv_line() -> str:
    from services.config import EngineConfig
    from services.models.info import ModelInfo

    tc = ModelInfo.load(EngineConfig(model="demo")).text_config
    heads = tc.num_key_value_heads
    per_token = 2 * tc.num_hidden_layers * heads * (tc.hidden_size // tc.num_attention_heads) * 4
    return (
        f"demo KV (fp32 on CPU): {per_token} B/token, {per_token * 16 // KIB} KiB per "
        f"16-token block; a 64-token prompt {per_token * 64 // KIB} KiB, the full "
        f"{tc.max_position_embeddings}-token context {per_token * tc.max_position_embeddings // MIB} MiB"
    )


def start_systems(fleet: Fleet) -> dict[str, int]:
    fleet.start_servers()
    for role in ("encoder", "prefill", "decode"):
        fleet.spawn(role, f"{role}-0")
    ports = {"disagg": fleet.spawn("gateway", "gateway-0"), "agg": fleet.spawn("all", "all-0")}
    t0 = time.perf_counter()
    for port in ports.values():
        fleet.wait_healthy(port, timeout_s=300)
    print(f"stack healthy after {time.perf_counter() - t0:.1f}s (logs in {fleet.logdir})")
    return ports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer rounds and bytes")
    s = QUICK if ap.parse_args().quick else Sizes()
    started = time.perf_counter()
    print(demo_kv_line())  # also generates the demo checkpoint once, before the children
    fleet = Fleet()
    try:
        ports = start_systems(fleet)
        res = asyncio.run(latency(ports, s.rounds, s.warmup, s.per_level))
        overhead = report_latency(res, s.rounds, s.per_level, MAX_TOKENS)
        fleet.check_alive()
        max_payload, rows = asyncio.run(measure_kv(fleet.nats.url, s.kv_sizes, s.kv_bytes_per_size))
        worst = report_kv(rows, max_payload)
    finally:
        fleet.close()
    print(
        f"\nGoal TTFT p50 overhead <= 10 ms (1 stream, all prompts): {overhead:+.1f} ms -> "
        f"{'met' if overhead <= 10 else 'MISSED'}"
    )
    print(
        f"Goal KV chunked >= 50 % of raw NATS publish: worst {worst:.0%} -> "
        f"{'met' if worst >= 0.5 else 'MISSED'}"
    )
    print(f"total {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
