"""Part 2 of bench/fleet_faults.py: routing policies on requests that share long
system prompts (the prefix-cache hit rate each policy reaches, TTFT, the prefill split).
``s`` is that script's ``Sizes``."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import replace

from _fleet import Rig, Stream, chat_request, stream
from _latency_stats import pct

from gateway.policies import POLICIES
from services.chat import render_chat


def ms(values: list[float], q: float) -> float:
    return pct(values, q) * 1e3 if values else float("nan")


def routing_workload(seed: int, s, vocab: list[str]) -> list[tuple[int, object]]:
    """(group, request) pairs, shuffled: ``groups`` system prompts x ``per_group``
    questions, every word drawn fresh for this seed."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(vocab, k=s.prefix_words)) for _ in range(s.groups)]
    pairs = []
    for grp, system in enumerate(systems):
        for q in range(s.per_group):
            question = f"question {q}: " + " ".join(rng.choices(vocab, k=12)) + "?"
            pairs.append(
                (grp, chat_request([("system", system), ("user", question)], s.routing_tokens))
            )
    rng.shuffle(pairs)
    return pairs


def oracle_cached(tok, pairs) -> tuple[int, int]:
    """(prompt tokens, cached tokens if each group missed once: (members - 1) x the full
    blocks its prompts share), tokenized as the gateway does."""
    by_group: dict[int, list[list[int]]] = {}
    for grp, req in pairs:
        msgs = [{"role": m.role, "content": m.parts[0].text} for m in req.chat.messages]
        ids = tok.encode(render_chat(tok, msgs)[0], add_special_tokens=False)
        by_group.setdefault(grp, []).append(list(ids))
    total = 0
    for prompts in by_group.values():
        common = len(prompts[0])
        for p in prompts[1:]:
            diff = (k for k, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
            common = min(common, next(diff, common))
        total += (len(prompts) - 1) * (common // 16 * 16)
    return sum(len(p) for ps in by_group.values() for p in ps), total


async def routing_run(rig: Rig, policy: str, pairs, s, group_key: bool, tag: int) -> dict:
    name = policy.split("[")[0]
    g = await rig.gateway(name)
    sem = asyncio.Semaphore(s.concurrency)

    async def one(i: int, grp: int, req) -> Stream:
        meta = (("x-session-id", f"group-{grp}-{tag}" if group_key else f"user-{i}-{tag}"),)
        async with sem:
            return await stream(g.stub, req, meta)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i, grp, req) for i, (grp, req) in enumerate(pairs)))
    wall = time.perf_counter() - t0
    split = Counter(iid for role, iid in g.picks if role == "prefill")
    prompt, oracle = oracle_cached(g.gateway.core.tokenizer, pairs)
    await rig.close_gateway(g)
    return {
        "ttft_s": [x.ttft for x in got if x.ttft is not None],
        "wall_s": wall,
        "errors": [x.error for x in got if x.error],
        "prompt": sum(x.prompt_tokens for x in got),
        "cached": sum(x.cached_tokens for x in got),
        "lost": sum(x.error is not None for x in got),
        "split": dict(split),
        "oracle": oracle,
        "oracle_prompt": prompt,
    }


async def routing(rig: Rig, s, model: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab = [w for w in tok.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3]
    vocab.sort()
    names = list(POLICIES) + ["consistent_hash[group key]"]
    res = {
        p: {
            "ttft_s": [],
            "prompt": 0,
            "cached": 0,
            "oracle": 0,
            "lost": 0,
            "wall_s": [],
            "split": Counter(),
            "errors": [],
        }
        for p in names
    }
    warm = routing_workload(10**6, replace(s, groups=2, per_group=4), vocab)
    await routing_run(rig, "least_loaded", warm, s, False, -1)
    for r in range(s.routing_rounds):
        for k in range(len(names)):
            p = names[(k + r) % len(names)]
            seed = 1000 * r + k
            pairs = routing_workload(seed, s, vocab)
            one = await routing_run(rig, p, pairs, s, "group" in p, seed)
            acc = res[p]
            acc["ttft_s"] += one["ttft_s"]
            acc["wall_s"].append(one["wall_s"])
            acc["split"].update(one["split"])
            acc["errors"] += one["errors"]
            for key in ("prompt", "cached", "lost"):
                acc[key] += one[key]
            acc["oracle"] += one["oracle"]
            if one["oracle_prompt"] != one["prompt"] and not one["lost"]:
                print(
                    f"note: prompt tokens {one['prompt']} != {one['oracle_prompt']} tokenized here"
                )
    return res


def report_routing(res: dict, s) -> None:
    n = s.groups * s.per_group
    mean_prompt = sum(r["prompt"] for r in res.values()) / (n * s.routing_rounds * len(res))
    print(
        f"\n## Part 2: routing, {s.groups} system prompts x {s.per_group} questions = {n} "
        f"requests per run, concurrency {s.concurrency}, max_tokens {s.routing_tokens}, "
        f"{s.routing_rounds} rounds; prompts of {mean_prompt:.0f} tokens on average\n"
    )
    print(
        "| policy | hit rate | oracle | TTFT p50 ms | TTFT p99 ms | run s | prefill split | lost |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for p, r in res.items():
        total = sum(r["split"].values()) or 1
        split = " / ".join(f"{i} {v / total:.0%}" for i, v in sorted(r["split"].items()))
        print(
            f"| {p} | {r['cached'] / r['prompt']:.1%} | {r['oracle'] / r['prompt']:.1%} | "
            f"{ms(r['ttft_s'], 50):.1f} | {ms(r['ttft_s'], 99):.1f} | "
            f"{sum(r['wall_s']) / len(r['wall_s']):.2f} | {split} | {r['lost']} |"
        )
    errors = sorted({(p, e) for p, r in res.items() for e in r["errors"]})
    for p, e in errors:
        print(f"\nerror seen ({p}): {e}")
