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
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from _fleet import Gw, LoopLag, Rig, Stream, Timing, chat_request, stream, wait_until  # noqa: E402
from _fleet_routing import ms, report_routing, routing  # noqa: E402

from gateway.policies import Candidate, Policy, RouteHint  # noqa: E402
from services.metrics import MIGRATIONS  # noqa: E402


@dataclass
class Sizes:
    """Workload sizes; ``--quick`` shrinks them."""

    kill_rounds: int = 2  # (a): undisturbed + killed runs of 16 streams
    tokens: int = 200  # per stream in (a) and (d)
    window_trials: int = 3  # (b): spaced bursts with and without a death
    window_requests: int = 8
    prefill_trials: int = 2  # (c)
    prefill_requests: int = 4
    short_grace_s: float = 0.3  # (d), second variant
    routing_rounds: int = 3
    groups: int = 16  # shared system prompts per run
    per_group: int = 8  # questions per system prompt
    prefix_words: int = 300
    concurrency: int = 8
    routing_tokens: int = 8


# Random llamas (tests/helpers/checkpoints.py), 2048 positions. "tiny" is the tests' own
# (hidden 64, 2 layers): a 300-token prefill costs about as much as the fleet's overheads,
# so prefix-cache hits barely show in TTFT; "small" (hidden 256, 4 layers) makes a miss
# cost ~3x a hit on this CPU.
CHECKPOINTS = {
    "tiny": {},
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}  # fmt: skip

QUICK = Sizes(kill_rounds=1, window_trials=1, prefill_trials=1, routing_rounds=1, per_group=4)


def migrations(role: str, kind: str) -> float:
    return MIGRATIONS.labels(role, kind)._value.get()


def moves(role: str) -> float:
    """Retries plus migrations of ``role`` so far."""
    return migrations(role, "retry") + migrations(role, "migration")


class Names:
    """New instance ids for replacements: d0 -> d2, p1 -> p2, ..."""

    def __init__(self):
        self.n = Counter({"p": 2, "d": 2})

    def next(self, role_letter: str) -> str:
        iid = f"{role_letter}{self.n[role_letter]}"
        self.n[role_letter] += 1
        return iid


async def replace(rig: Rig, g: Gw, names: Names, dead: str) -> str:
    """A new instance of ``dead``'s role, live in ``g``; ``dead`` gone from its registry."""
    iid = names.next(dead[0])
    rig.spawn(iid)
    await rig.wait_live(g)
    await rig.wait_gone(g, dead)
    return iid


def text_request(i: int, tokens: int, words: int = 8):
    text = f"request {i}: " + " ".join(f"w{i}x{j}" for j in range(words))
    return chat_request([("user", text)], tokens)


async def run_streams(g: Gw, reqs, meta=(), after: int = 20, action=None):
    """All ``reqs`` as streams; ``action()`` (sync) once each has ``after`` tokens.
    Returns (streams, total seconds, time of the action or None)."""
    streams = [Stream(0.0) for _ in reqs]
    fired: list[float] = []

    def check() -> None:
        if action and not fired and all(len(s.tokens) >= after for s in streams):
            fired.append(time.perf_counter())
            action()

    t0 = time.perf_counter()
    await asyncio.gather(*(stream(g.stub, r, meta, on_token=check, out=s)
                           for r, s in zip(reqs, streams, strict=True)))  # fmt: skip
    return streams, time.perf_counter() - t0, (fired[0] if fired else None)


def outcome(got: list[Stream], ref: list[Stream], tokens: int) -> dict:
    return {"n": len(got), "completed": sum(s.error is None and len(s.tokens) == tokens for s in got),
            "lost": sum(s.error is not None for s in got),
            "identical": sum(s.tokens == r.tokens for s, r in zip(got, ref, strict=True)),
            "errors": sorted({s.error for s in got if s.error})}  # fmt: skip


async def kill_decode(rig: Rig, names: Names, s: Sizes) -> dict:
    """(a) kill -9 of the decode serving 16 streams."""
    g = await rig.gateway("consistent_hash")
    meta = (("x-session-id", "s1"),)
    out = {"n": 0, "completed": 0, "lost": 0, "identical": 0, "errors": [], "gaps_s": [],
           "tpot_s": [], "undisturbed_s": [], "killed_s": [], "on_victim": [], "migrations": 0}  # fmt: skip
    await run_streams(g, [text_request(-1 - i, 16) for i in range(4)], meta)  # warm-up
    for r in range(s.kill_rounds):
        reqs = [text_request(100 * r + i, s.tokens) for i in range(16)]
        ref, t_ref, _ = await run_streams(g, reqs, meta)
        victim: list[str] = []

        def kill(victim: list[str] = victim) -> None:
            load = g.load("decode")
            victim.append(max(load, key=load.get))
            out["on_victim"].append(load[victim[0]])
            rig.worker(victim[0]).kill()

        before = migrations("decode", "migration")
        got, t_got, t_kill = await run_streams(g, reqs, meta, action=kill)
        out["migrations"] += migrations("decode", "migration") - before
        for k, v in outcome(got, ref, s.tokens).items():
            out[k] += v
        out["gaps_s"] += [x for x in (st.stall_after(t_kill) for st in got) if x is not None]
        out["tpot_s"] += [
            b - a for st in ref for a, b in zip(st.times, st.times[1:], strict=False) if b > a
        ]
        out["undisturbed_s"].append(t_ref)
        out["killed_s"].append(t_got)
        await replace(rig, g, names, victim[0])
    await rig.close_gateway(g)
    return out


async def spaced(g: Gw, reqs, span_s: float) -> list[Stream]:
    """``reqs`` sent evenly over ``span_s`` seconds."""

    async def one(i: int, req) -> Stream:
        await asyncio.sleep(i * span_s / len(reqs))
        return await stream(g.stub, req)

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))


async def death_window(rig: Rig, names: Names, s: Sizes) -> dict:
    """(b) TTFT during the expiry window after a decode death, vs no death."""
    g = await rig.gateway("prefix_aware")
    out = {"calm": [], "death": [], "calm_e2e": [], "death_e2e": [], "calm_lost": 0,
           "death_lost": 0, "to_dead": 0, "moves": 0}  # fmt: skip
    n = s.window_requests
    for t in range(s.window_trials):
        calm = await spaced(
            g, [text_request(5000 + 100 * t + i, 16) for i in range(n)], rig.timing.ttl_s
        )
        dead = sorted(g.load("decode"))[t % 2]
        before, mark = moves("decode"), len(g.picks)
        rig.worker(dead).kill()
        death = await spaced(
            g, [text_request(6000 + 100 * t + i, 16) for i in range(n)], rig.timing.ttl_s
        )
        out["moves"] += moves("decode") - before
        out["to_dead"] += sum(p == ("decode", dead) for p in g.picks[mark:])
        for key, got in (("calm", calm), ("death", death)):
            out[key] += [x.ttft for x in got if x.ttft is not None]
            out[f"{key}_e2e"] += [x.times[-1] - x.sent for x in got if x.error is None]
            out[f"{key}_lost"] += sum(x.error is not None for x in got)
        await replace(rig, g, names, dead)
        await spaced(g, [text_request(-100 - i, 8) for i in range(4)], 0.0)  # warm the new one
    await rig.close_gateway(g)
    return out


async def hold_in_frozen_prefills(rig: Rig, g: Gw, reqs) -> tuple[list, list[str]]:
    """Send ``reqs`` one by one while every prefill is stopped; which prefill holds each."""
    tasks, holders = [], []
    for req in reqs:
        before = g.load("prefill")
        tasks.append(asyncio.ensure_future(stream(g.stub, req)))
        await wait_until(lambda b=before: sum(g.load("prefill").values()) > sum(b.values()), 10)
        after = g.load("prefill")
        holders.append(next(i for i in after if after[i] > before.get(i, 0)))
    return tasks, holders


async def kill_prefill(rig: Rig, names: Names, s: Sizes) -> dict:
    """(c) frozen prefills, one killed, the rest resumed."""
    g = await rig.gateway("round_robin")
    out = {"n": 0, "completed": 0, "lost": 0, "identical": 0, "errors": [], "retries": 0,
           "ref_ttft_s": [], "victim_ttft_s": [], "survivor_ttft_s": [], "frozen_s": []}  # fmt: skip
    for t in range(s.prefill_trials):
        reqs = [text_request(7000 + 100 * t + i, 32, words=40) for i in range(s.prefill_requests)]
        ref = [await stream(g.stub, r) for r in reqs]
        out["ref_ttft_s"] += [x.ttft for x in ref]
        prefills = [w.instance_id for w in rig.running("prefill")]
        before = migrations("prefill", "retry")
        t_stop = time.perf_counter()
        for iid in prefills:
            rig.signal(iid, signal.SIGSTOP)
        try:
            tasks, holders = await hold_in_frozen_prefills(rig, g, reqs)
            victim = holders[0]
            rig.worker(victim).kill()
        finally:
            for iid in prefills:
                if rig.worker(iid).proc.poll() is None:
                    rig.signal(iid, signal.SIGCONT)
        out["frozen_s"].append(time.perf_counter() - t_stop)
        got = list(await asyncio.gather(*tasks))
        out["retries"] += migrations("prefill", "retry") - before
        for k, v in outcome(got, ref, 32).items():
            out[k] += v
        for x, h in zip(got, holders, strict=True):
            if x.ttft is not None:
                out["victim_ttft_s" if h == victim else "survivor_ttft_s"].append(x.ttft)
        await replace(rig, g, names, victim)
    await rig.close_gateway(g)
    return out


def session_for(target: str, decodes: list[str]) -> str:
    """A session key that consistent_hash sends to ``target`` among ``decodes``."""
    policy = Policy("consistent_hash")
    cands = [Candidate(i, 0, 0, 0.0) for i in decodes]
    return next(k for k in (f"s-{n}" for n in range(10_000))
                if policy.choose(cands, RouteHint(k)).instance_id == target)  # fmt: skip


async def drain_decode(rig: Rig, names: Names, s: Sizes) -> list[dict]:
    """(d) SIGTERM of the decode serving 8 streams: default grace, then a short one."""
    rows = []
    for grace in (rig.timing.grace_s, s.short_grace_s):
        g = await rig.gateway("consistent_hash")
        iid = names.next("d")
        rig.fleet.spawn("decode", iid, EPD_SHUTDOWN_GRACE_S=str(grace))
        await rig.wait_live(g)
        meta = (("x-session-id", session_for(iid, sorted(g.load("decode")))),)
        reqs = [text_request(8000 + i, s.tokens) for i in range(8)]
        await run_streams(g, reqs[:2], meta)  # warm-up of the new instance
        ref, t_ref, _ = await run_streams(g, reqs, meta)
        before = migrations("decode", "migration")
        got, t_got, t_term = await run_streams(
            g, reqs, meta, action=lambda i=iid: rig.signal(i, signal.SIGTERM)
        )  # fmt: skip
        proc = rig.worker(iid).proc
        code = await asyncio.to_thread(proc.wait, 60)
        row = {"grace_s": grace, **outcome(got, ref, s.tokens), "undisturbed_s": t_ref,
               "sigterm_s": t_got, "exit_code": code, "exit_after_s": time.perf_counter() - t_term,
               "migrations": migrations("decode", "migration") - before}  # fmt: skip
        rows.append(row)
        await rig.wait_gone(g, iid)
        await rig.close_gateway(g)
    return rows


# -- report ---------------------------------------------------------------------------


def report_faults(a: dict, b: dict, c: dict, d: list[dict], timing: Timing) -> None:
    print(f"\n## Part 1: faults (heartbeat {timing.heartbeat_s:g}s, expiry {timing.ttl_s:g}s)\n")
    print("| scenario | requests | completed | lost | identical | figures |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    und, kil = a["undisturbed_s"], a["killed_s"]
    print(f"| (a) kill -9 decode holding {'/'.join(map(str, a['on_victim']))} streams | {a['n']} | "
          f"{a['completed']} | {a['lost']} | {a['identical']} | migration stall p50 "
          f"{ms(a['gaps_s'], 50):.0f} ms, p99 {ms(a['gaps_s'], 99):.0f} ms (normal token gap p50 "
          f"{ms(a['tpot_s'], 50):.1f} ms, p99 {ms(a['tpot_s'], 99):.1f} ms); total "
          f"{sum(kil) / len(kil):.2f} s vs {sum(und) / len(und):.2f} s undisturbed; "
          f"{a['migrations']:.0f} migrations |")  # fmt: skip
    for key, label in (("calm", "no death"), ("death", "decode killed at t=0")):
        xs, e2e, lost = b[key], b[f"{key}_e2e"], b[f"{key}_lost"]
        extra = (f"; {b['to_dead']} routed to the dead decode, {b['moves']:.0f} moved"
                 if key == "death" else "")  # fmt: skip
        print(f"| (b) 16-token requests spaced over {timing.ttl_s:g}s, {label} | "
              f"{len(e2e) + lost} | {len(e2e)} | {lost} | - | TTFT p50 {ms(xs, 50):.0f} ms, "
              f"p99 {ms(xs, 99):.0f} ms; last token p50 {ms(e2e, 50):.0f} ms, p99 "
              f"{ms(e2e, 99):.0f} ms{extra} |")  # fmt: skip
    print(f"| (c) prefills frozen, one killed | {c['n']} | {c['completed']} | {c['lost']} | "
          f"{c['identical']} | TTFT from send: killed prefill's p50 {ms(c['victim_ttft_s'], 50):.0f}"
          f" ms, max {ms(c['victim_ttft_s'], 100):.0f} ms; survivor's p50 "
          f"{ms(c['survivor_ttft_s'], 50):.0f} ms; undisturbed p50 {ms(c['ref_ttft_s'], 50):.0f} ms;"
          f" frozen {sum(c['frozen_s']) / len(c['frozen_s']):.2f} s; {c['retries']:.0f} retries |")  # fmt: skip
    for row in d:
        print(f"| (d) SIGTERM decode holding 8 streams, grace {row['grace_s']:g}s | {row['n']} | "
              f"{row['completed']} | {row['lost']} | {row['identical']} | total "
              f"{row['sigterm_s']:.2f} s vs {row['undisturbed_s']:.2f} s undisturbed; exit "
              f"{row['exit_code']} {row['exit_after_s']:.2f} s after SIGTERM; "
              f"{row['migrations']:.0f} migrations |")  # fmt: skip
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
    for key, field in (("rounds", "routing_rounds"), ("groups", "groups"),
                       ("per_group", "per_group"), ("concurrency", "concurrency")):  # fmt: skip
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
    print(f"\nthis process's event loop (gateway + clients): worst lag {lag.get('worst_s', 0):.2f}s, "
          f"{lag.get('stalls_over_1s', 0)} stalls over 1s")  # fmt: skip
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
