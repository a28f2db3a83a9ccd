"""Where our engine's time goes on one ``vs_vllm.py`` workload, step by step.

    taskset -c 0 python bench/_vs_vllm_profile.py --workload mixed [--cprofile]

Loads our ``LLM`` as ``vs_vllm.py`` does, wraps (in this process only) the engine's step
phases and the CPU backend's ops with timers, runs the workload once and prints:
- steps by kind (pure prefill, mixed prefill + decode, pure decode): count, seconds,
  prefill tokens and decode rows, mean batch;
- the step's phases: scheduling, input preparation, the model, the LM head + argmax,
  the scheduler's update, the engine's output processing (the rest of ``step``);
- the model's ops (attention split into steps served natively and steps that left chunks
  to the per-sequence SDPA fallback), summed over layers.
``--cprofile`` also prints the top functions by own time (cProfile inflates Python's
share; the phase timers are the figures to quote).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import _peers_checkpoint as ckpt  # noqa: E402
import _vs_vllm_workloads as workloads  # noqa: E402
from _vs_vllm_steps import STEPS, TIMES, report, timed  # noqa: E402
from _vs_vllm_worker import WARM_LENGTHS, Ours  # noqa: E402


def _attention_kind(backend) -> str:
    """The timer of the attention call just made: did its plan leave chunks to SDPA?"""
    plan = backend._plan[1]
    sdpa = plan is not None and plan.sdpa_meta is not None
    return "op: attention (step with SDPA fallback)" if sdpa else "op: attention (native)"


def instrument(engine) -> None:
    """Timers on the engine's phases and backend ops; one STEPS row per step."""
    runner, backend, sched = engine.runner, engine.backend, engine.scheduler
    timed(sched, "schedule", "phase: schedule")
    timed(runner, "prepare", "phase: prepare inputs")
    timed(runner, "_forward", "phase: model (decoder stack)")
    timed(engine.model, "greedy_tokens", "phase: LM head + argmax")
    timed(sched, "update_from_output", "phase: scheduler update")
    for op in ("linear", "rms_norm", "silu_mul", "rotary", "write_kv", "decode_stack"):
        if hasattr(backend, op):
            timed(backend, op, f"op: {op}")
    timed(backend, "attention", "", split=lambda *_: _attention_kind(backend))
    step = engine.step

    def logged_step():
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        so = engine._last_so  # noqa: SLF001 (set below)
        pre = sum(i.num_new_tokens for i in so.scheduled if i.num_new_tokens > 1)
        dec = sum(1 for i in so.scheduled if i.num_new_tokens == 1)
        STEPS.append([pre, dec, dt])
        TIMES["phase: engine step (total)"][1] += dt
        TIMES["phase: engine step (total)"][0] += 1
        return out

    schedule = sched.schedule

    def keep(*args, **kwargs):
        engine._last_so = schedule(*args, **kwargs)  # noqa: SLF001
        return engine._last_so

    sched.schedule = keep
    engine.step = logged_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="mixed", choices=workloads.NAMES)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/peers/ckpt"))
    args = ap.parse_args()
    w = workloads.build(args.workload)
    ours = Ours(str(ckpt.text_checkpoint(args.cache_dir)), w.threads)
    ours.run(workloads.random_prompts(random.Random(0), WARM_LENGTHS), [4] * len(WARM_LENGTHS))
    instrument(ours.llm.engine)
    prof = cProfile.Profile() if args.cprofile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    ids = ours.run(w.prompts, w.outputs)
    if prof:
        prof.disable()
    report(time.perf_counter() - t0, sum(len(i) for i in ids))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
