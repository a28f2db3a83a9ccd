"""Faults and routing policies on a fleet of worker processes (text checkpoint).

    python bench/fleet_faults.py                  # full run, 5-8 minutes on 2 busy cores
    python bench/fleet_faults.py --quick          # smoke run
    python bench/fleet_faults.py --model DIR --json out.json

Private NATS and Redis; 2 prefill and 2 decode instances as ``epd serve`` processes; a
fresh gateway per scenario / policy run in this process (its router is inspected). The
default checkpoint is a random llama from tests/helpers/checkpoints (``--size``).
Heartbeat period and expiry default to the production ones (1 s / 3 s). Greedy
(``temperature=0, ignore_eos``): "identical" means the same tokens as an undisturbed run.
A killed worker is replaced by a new instance (new id) before the next trial.

Part 1, faults:
  (a) kill -9 of the decode serving 16 streams (consistent_hash, one x-session-id: all
      on one decode), once each stream has 20 tokens. gap = the longest wait between two
      tokens after the kill, per stream; total = first send -> last stream done.
  (b) TTFT and last-token latency of short requests sent evenly over one expiry window
      (ttl_s) right after an idle decode is killed, against the same spaced burst with
      nobody killed (token 1 comes from prefill: a dead decode shows after it).
  (c) both prefills frozen (SIGSTOP), requests sent (round_robin: each prefill holds
      some), one prefill killed, the other resumed; TTFT from the send.
  (d) SIGTERM of the decode serving 8 streams (graceful drain), with the default grace
      (streams finish) and a short one (the rest is handed back and migrates).
Part 2, routing: groups of requests share a long system prompt (~300 tokens), each with
  its own question, shuffled and sent at a fixed concurrency, through 2 prefills. Per
  policy: prefix-cache hit rate (usage.cached_tokens / prompt tokens; "oracle" = one miss
  per group), TTFT, the prefill split. Fairness: the worker processes stay up, so every
  (policy, round) run gets its own fresh system prompts: no run finds another's prefixes
  in the caches. Policies are interleaved across rounds, the order rotated each round.

The gateway shares this process's event loop with the clients: its worst stall is
printed, since a stall longer than the expiry makes the gateway drop live instances.
No pass/fail: figures only. The machine's cores are shared; expect noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from _fleet import LoopLag, Rig, Timing  # noqa: E402
from _fleet_faults import (  # noqa: E402
    CHECKPOINTS,
    QUICK,
    Names,
    Sizes,
    death_window,
    drain_decode,
    kill_decode,
    kill_prefill,
)
from _fleet_routing import ms, report_routing, routing  # noqa: E402

# -- report ---------------------------------------------------------------------------


def report_faults(a: dict, b: dict, c: dict, d: list[dict], timing: Timing) -> None:
    print(f"\n## Part 1: faults (heartbeat {timing.heartbeat_s:g}s, expiry {timing.ttl_s:g}s)\n")
    print("| scenario | requests | completed | lost | identical | figures |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    und, kil = a["undisturbed_s"], a["killed_s"]
    print(
        f"| (a) kill -9 decode holding {'/'.join(map(str, a['on_victim']))} streams | {a['n']} | "
        f"{a['completed']} | {a['lost']} | {a['identical']} | migration stall p50 "
        f"{ms(a['gaps_s'], 50):.0f} ms, p99 {ms(a['gaps_s'], 99):.0f} ms (normal token gap p50 "
        f"{ms(a['tpot_s'], 50):.1f} ms, p99 {ms(a['tpot_s'], 99):.1f} ms); total "
        f"{sum(kil) / len(kil):.2f} s vs {sum(und) / len(und):.2f} s undisturbed; "
        f"{a['migrations']:.0f} migrations |"
    )
    for key, label in (("calm", "no death"), ("death", "decode killed at t=0")):
        xs, e2e, lost = b[key], b[f"{key}_e2e"], b[f"{key}_lost"]
        extra = (
            f"; {b['to_dead']} routed to the dead decode, {b['moves']:.0f} moved"
            if key == "death"
            else ""
        )
        print(
            f"| (b) 16-token requests spaced over {timing.ttl_s:g}s, {label} | "
            f"{len(e2e) + lost} | {len(e2e)} | {lost} | - | TTFT p50 {ms(xs, 50):.0f} ms, "
            f"p99 {ms(xs, 99):.0f} ms; last token p50 {ms(e2e, 50):.0f} ms, p99 "
            f"{ms(e2e, 99):.0f} ms{extra} |"
        )
    print(
        f"| (c) prefills frozen, one killed | {c['n']} | {c['completed']} | {c['lost']} | "
        f"{c['identical']} | TTFT from send: killed prefill's p50 {ms(c['victim_ttft_s'], 50):.0f}"
        f" ms, max {ms(c['victim_ttft_s'], 100):.0f} ms; survivor's p50 "
        f"{ms(c['survivor_ttft_s'], 50):.0f} ms; undisturbed p50 {ms(c['ref_ttft_s'], 50):.0f} ms;"
        f" frozen {sum(c['frozen_s']) / len(c['frozen_s']):.2f} s; {c['retries']:.0f} retries |"
    )
    for row in d:
        print(
            f"| (d) SIGTERM decode holding 8 streams, grace {row['grace_s']:g}s | {row['n']} | "
            f"{row['completed']} | {row['lost']} | {row['identical']} | total "
            f"{row['sigterm_s']:.2f} s vs {row['undisturbed_s']:.2f} s undisturbed; exit "
            f"{row['exit_code']} {row['exit_after_s']:.2f} s after SIGTERM; "
            f"{row['migrations']:.0f} migrations |"
        )
    errors = sorted(set(a["errors"] + c["errors"] + [e for r in d for e in r["errors"]]))
    if errors:
        print(f"\nerrors seen: {errors}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer rounds and requests")
    ap.add_argument("--model", help="text checkpoint directory (default: a random llama)")
    ap.add_argument(
        "--size",
        choices=CHECKPOINTS,
        default="small",
        help="the random llama's size, without --model (default small)",
    )
    ap.add_argument("--rounds", type=int, help="routing rounds (default 3)")
    ap.add_argument("--groups", type=int, help="system prompts per routing run (default 16)")
    ap.add_argument("--per-group", type=int, help="questions per system prompt (default 8)")
    ap.add_argument("--concurrency", type=int, help="routing streams at once (default 8)")
    ap.add_argument("--only", choices=("faults", "routing"), help="run one part")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--ttl-s", type=float, default=3.0, help="instance expiry")
    ap.add_argument("--grace-s", type=float, default=10.0, help="workers' drain grace")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--log-level", default="WARNING", help="this process (gateway) log level")
    args = ap.parse_args()
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("services.bus.heartbeat").setLevel(logging.INFO)  # expiries: deaths seen
    s = QUICK if args.quick else Sizes()
    for key, field in (
        ("rounds", "routing_rounds"),
        ("groups", "groups"),
        ("per_group", "per_group"),
        ("concurrency", "concurrency"),
    ):
        if getattr(args, key) is not None:
            setattr(s, field, getattr(args, key))
    timing = Timing(args.heartbeat_s, args.ttl_s, args.grace_s)
    model = args.model or str(default_checkpoint(args.size))
    started = time.perf_counter()
    rig = Rig(model, timing)
    out: dict = {"sizes": asdict(s), "timing": asdict(timing), "model": model}
    try:
        rig.start(["p0", "p1", "d0", "d1"])
        out |= asyncio.run(run_parts(rig, s, model, args.only))
    finally:
        rig.close()
    if "faults" in out:
        report_faults(*out["faults"], timing)
    if "routing" in out:
        report_routing(out["routing"], s)
    lag = out.get("loop_lag", {})
    print(
        f"\nthis process's event loop (gateway + clients): worst lag {lag.get('worst_s', 0):.2f}s, "
        f"{lag.get('stalls_over_1s', 0)} stalls over 1s"
    )
    print(f"logs in {rig.logdir}; total {time.perf_counter() - started:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=list))
    return 0


def default_checkpoint(size: str) -> Path:
    from tests.helpers.checkpoints import make_text_checkpoint

    root = Path(tempfile.gettempdir()) / "epd-bench-fleet-ckpt" / size
    return make_text_checkpoint(root, "llama", max_position_embeddings=2048, **CHECKPOINTS[size])


async def run_parts(rig: Rig, s: Sizes, model: str, only: str | None) -> dict:
    out, names, lag = {}, Names(), LoopLag()
    lag.start()
    try:
        return await _parts(rig, s, model, only, out, names)
    finally:
        lag.stop()
        out["loop_lag"] = {"worst_s": lag.worst, "stalls_over_1s": lag.over_1s}


async def _parts(rig: Rig, s: Sizes, model: str, only: str | None, out: dict, names: Names) -> dict:
    t0 = time.perf_counter()
    g = await rig.gateway("least_loaded")  # the fleet is up
    await rig.close_gateway(g)
    print(f"fleet live after {time.perf_counter() - t0:.1f}s (logs in {rig.logdir})", flush=True)
    if only in (None, "faults"):
        a = await kill_decode(rig, names, s)
        print(f"(a) done at {time.perf_counter() - t0:.0f}s", flush=True)
        b = await death_window(rig, names, s)
        print(f"(b) done at {time.perf_counter() - t0:.0f}s", flush=True)
        c = await kill_prefill(rig, names, s)
        print(f"(c) done at {time.perf_counter() - t0:.0f}s", flush=True)
        d = await drain_decode(rig, names, s)
        print(f"(d) done at {time.perf_counter() - t0:.0f}s", flush=True)
        out["faults"] = (a, b, c, d)
    if only in (None, "routing"):
        out["routing"] = await routing(rig, s, model)
        print(f"routing done at {time.perf_counter() - t0:.0f}s", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
