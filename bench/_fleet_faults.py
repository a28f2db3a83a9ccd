"""Part 1 of bench/fleet_faults.py: the fault scenarios (a)-(d), their sizes and the
outcome of each trial against an undisturbed run (the module docstring there says what
each scenario does)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass

from _fleet import Gw, Rig, Stream, chat_request, stream, wait_until

from gateway.policies import Candidate, Policy, RouteHint
from services.metrics import MIGRATIONS


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
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    ),
}

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
    await asyncio.gather(
        *(
            stream(g.stub, r, meta, on_token=check, out=s)
            for r, s in zip(reqs, streams, strict=True)
        )
    )
    return streams, time.perf_counter() - t0, (fired[0] if fired else None)


def outcome(got: list[Stream], ref: list[Stream], tokens: int) -> dict:
    return {
        "n": len(got),
        "completed": sum(s.error is None and len(s.tokens) == tokens for s in got),
        "lost": sum(s.error is not None for s in got),
        "identical": sum(s.tokens == r.tokens for s, r in zip(got, ref, strict=True)),
        "errors": sorted({s.error for s in got if s.error}),
    }


async def kill_decode(rig: Rig, names: Names, s: Sizes) -> dict:
    """(a) kill -9 of the decode serving 16 streams."""
    g = await rig.gateway("consistent_hash")
    meta = (("x-session-id", "s1"),)
    out = {
        "n": 0,
        "completed": 0,
        "lost": 0,
        "identical": 0,
        "errors": [],
        "gaps_s": [],
        "tpot_s": [],
        "undisturbed_s": [],
        "killed_s": [],
        "on_victim": [],
        "migrations": 0,
    }
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
    out = {
        "calm": [],
        "death": [],
        "calm_e2e": [],
        "death_e2e": [],
        "calm_lost": 0,
        "death_lost": 0,
        "to_dead": 0,
        "moves": 0,
    }
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
    out = {
        "n": 0,
        "completed": 0,
        "lost": 0,
        "identical": 0,
        "errors": [],
        "retries": 0,
        "ref_ttft_s": [],
        "victim_ttft_s": [],
        "survivor_ttft_s": [],
        "frozen_s": [],
    }
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
    return next(
        k
        for k in (f"s-{n}" for n in range(10_000))
        if policy.choose(cands, RouteHint(k)).instance_id == target
    )


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
        )
        proc = rig.worker(iid).proc
        code = await asyncio.to_thread(proc.wait, 60)
        row = {
            "grace_s": grace,
            **outcome(got, ref, s.tokens),
            "undisturbed_s": t_ref,
            "sigterm_s": t_got,
            "exit_code": code,
            "exit_after_s": time.perf_counter() - t_term,
            "migrations": migrations("decode", "migration") - before,
        }
        rows.append(row)
        await rig.wait_gone(g, iid)
        await rig.close_gateway(g)
    return rows
