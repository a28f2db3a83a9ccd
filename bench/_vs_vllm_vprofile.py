"""Where vLLM's CPU build spends one ``vs_vllm.py`` workload (run with vLLM's python).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_AOT_COMPILE=0 VLLM_CPU_KVCACHE_SPACE=1 \\
    VLLM_CPU_OMP_THREADS_BIND=0 taskset -c 0 /tmp/peers/vllm/bin/python \\
        bench/_vs_vllm_vprofile.py --model /tmp/peers/ckpt/peers-llama --workload mixed

With multiprocessing off, vLLM's engine core and its worker run in this process, so the
same timers as ``_vs_vllm_profile.py`` wrap its step phases: scheduling, the model's
forward (``execute_model``: input preparation + the compiled model), sampling
(``sample_tokens``), the scheduler's update, and the front end's output processing (the
rest of ``LLMEngine.step``). ``--ops`` runs the workload a second time under
``torch.profiler`` and prints the ops by own CPU time (the profiler slows every op; read
its shares, not its seconds). In-process, vLLM runs no slower on one core than with its
three processes (they take turns on the core anyway).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _vs_vllm_workloads as workloads  # noqa: E402
from _vs_vllm_steps import STEPS, TIMES, report, timed  # noqa: E402
from _vs_vllm_worker import WARM_LENGTHS, Vllm  # noqa: E402


def instrument(llm) -> None:
    """Timers on the in-process engine core's phases."""
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    timed(core.scheduler, "update_from_output", "phase: scheduler update")
    timed(core.model_executor, "execute_model", "phase: execute_model (inputs + model)")
    timed(core.model_executor, "sample_tokens", "phase: sample_tokens")
    schedule = core.scheduler.schedule

    def schedule_logged(*args, **kwargs):
        t0 = time.perf_counter()
        so = schedule(*args, **kwargs)
        TIMES["phase: schedule"][0] += 1
        TIMES["phase: schedule"][1] += time.perf_counter() - t0
        counts = so.num_scheduled_tokens.values()
        STEPS.append([sum(n for n in counts if n > 1), sum(1 for n in counts if n == 1), 0.0])
        return so

    core.scheduler.schedule = schedule_logged
    step = core.step

    def step_logged(*args, **kwargs):
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        if STEPS:
            STEPS[-1][2] = time.perf_counter() - t0
        return out

    core.step = step_logged
    core.step_fn = step_logged if core.step_fn == step else core.step_fn
    timed(engine, "step", "phase: LLMEngine.step (total)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", default="mixed", choices=workloads.NAMES)
    ap.add_argument("--ops", action="store_true", help="a second run under torch.profiler")
    args = ap.parse_args()
    w = workloads.build(args.workload)
    system = Vllm(args.model, w.threads)
    system.run(workloads.random_prompts(random.Random(0), WARM_LENGTHS), [4] * len(WARM_LENGTHS))
    instrument(system.llm)
    STEPS.clear()
    t0 = time.perf_counter()
    ids = system.run(w.prompts, w.outputs)
    report(time.perf_counter() - t0, sum(len(i) for i in ids))
    if args.ops:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            system.run(w.prompts, w.outputs)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
