"""The speculative-decoding benchmark's engine part: every configuration end to end.

One ``LLM`` per configuration (plain, and n-gram / EAGLE-3 / P-EAGLE at each k), all
loaded up front and warmed up; then, per round, each one generates the same greedy
continuations at batch 1 (prompts one after another) and batch 8 (all at once), in an
order reversed every round so that drift on the shared machine spreads evenly. Time spent
inside the proposer is clocked by wrapping its ``propose``, which splits a speculative
step into drafting and verification.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from pathlib import Path

from services.llm import LLM
from services.sampling_params import SamplingParams

log = logging.getLogger("bench.spec")
_ids = itertools.count()


def configs(heads: dict, ks) -> dict[str, dict | None]:
    """Name -> speculative_config (None: plain decoding)."""
    out: dict[str, dict | None] = {"plain": None}
    for k in ks:
        out[f"ngram k={k}"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
        out[f"eagle3 k={k}"] = {
            "method": "eagle3",
            "model": str(heads["eagle3"]),
            "num_speculative_tokens": k,
        }
        out[f"p-eagle k={k}"] = {
            "method": "eagle3",
            "model": str(heads["peagle"]),
            "num_speculative_tokens": k,
            "parallel_drafting": True,
        }
    return out


def _clock_proposer(llm: LLM) -> list[float]:
    """Accumulate seconds spent in the proposer's ``propose`` into the returned cell."""
    cell = [0.0]
    spec = llm.engine.spec
    if spec is None:
        return cell
    inner = spec.proposer.propose

    def timed(batch, k):
        t0 = time.perf_counter()
        try:
            return inner(batch, k)
        finally:
            cell[0] += time.perf_counter() - t0

    spec.proposer.propose = timed
    return cell


def run_once(llm: LLM, prompts: list[list[int]], batch: int, new: int) -> dict:
    """Generate ``new`` greedy tokens per prompt, ``batch`` requests at a time."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    stats = eng.spec.stats if eng.spec is not None else None
    before = (stats.verifications, stats.accepted_tokens) if stats else (0, 0)
    outputs, steps, seconds = [], 0, 0.0
    for start in range(0, len(prompts), batch):
        rids = []
        for p in prompts[start : start + batch]:
            rids.append(f"bench-{next(_ids)}")
            eng.add_request(rids[-1], {"prompt_token_ids": p}, sp, final_only=True)
        done = {}
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
        seconds += time.perf_counter() - t0
        outputs += [list(done[r]) for r in rids]
    ver = stats.verifications - before[0] if stats else 0
    acc = stats.accepted_tokens - before[1] if stats else 0
    return {
        "outputs": outputs,
        "tokens": sum(map(len, outputs)),
        "seconds": seconds,
        "steps": steps,
        "verifications": ver,
        "accepted": acc,
    }


def run_engine_suite(target_dir: Path, heads: dict, prompts, new: int, rounds: int, ks) -> dict:
    """Tokens/s, speed-up, acceptance and step costs per configuration and batch size."""
    engines, clocks = {}, {}
    for name, cfg in configs(heads, ks).items():
        engines[name] = LLM(
            model=str(target_dir), speculative_config=cfg, device="cpu", num_kv_blocks=256
        )  # 10 engines: a small pool each
        clocks[name] = _clock_proposer(engines[name])
        run_once(engines[name], prompts[:1], 1, 8)  # warm-up (kernels, allocations)
    results = {}
    for batch in (1, 8):
        samples = {name: [] for name in engines}
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                clocks[name][0] = 0.0
                res = run_once(engines[name], prompts, batch, new)
                res["propose_seconds"] = clocks[name][0]
                samples[name].append(res)
                log.info(
                    "batch %d round %d %-12s %.1f tok/s",
                    batch,
                    r,
                    name,
                    res["tokens"] / res["seconds"],
                )
        results[f"batch {batch}"] = _summarise(samples)
    return results


def _summarise(samples: dict[str, list[dict]]) -> dict:
    """Medians over rounds; speed-up and step costs relative to plain decoding."""
    plain = samples["plain"]
    plain_tps = statistics.median(s["tokens"] / s["seconds"] for s in plain)
    plain_step = statistics.median(s["seconds"] / s["steps"] for s in plain)
    reference = plain[0]["outputs"]
    table = {}
    for name, runs in samples.items():
        tps = statistics.median(s["tokens"] / s["seconds"] for s in runs)
        step = statistics.median(s["seconds"] / s["steps"] for s in runs)
        verify = statistics.median((s["seconds"] - s["propose_seconds"]) / s["steps"] for s in runs)
        ver = sum(s["verifications"] for s in runs)
        acc = sum(s["accepted"] for s in runs)
        table[name] = {
            "tokens_per_s": round(tps, 1),
            "speedup": round(tps / plain_tps, 3),
            "mean_acceptance_length": round((acc + ver) / ver, 3) if ver else None,
            "step_ms": round(step * 1e3, 3),
            "step_vs_plain": round(step / plain_step, 3),
            "verify_vs_plain": round(verify / plain_step, 3),
            "identical_to_plain": all(s["outputs"] == reference for s in runs),
        }
    return table
