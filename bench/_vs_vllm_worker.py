"""One system of ``vs_vllm.py``, loaded once, running workloads on request.

    python _vs_vllm_worker.py --system ours|vllm --model DIR --threads N

Runs in our venv (``ours``) or in vLLM's (``vllm``). It reads one JSON command a line on
stdin (``{"workload": NAME}``), runs that workload's one ``generate`` call after resetting
the prefix cache (every round starts cold, like the first), and answers one JSON line:
``{"seconds": ..., "tokens": ..., "digest": [...]}`` (a short hash of each request's
output ids, to compare greedy outputs across systems). Everything else the systems print
goes to stderr: the protocol keeps a private copy of stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _vs_vllm_workloads as workloads  # noqa: E402

KV_GIB = 1  # both systems' KV pools (vLLM: VLLM_CPU_KVCACHE_SPACE)
WARM_LENGTHS = [16, 64, 128, 300, 512, 1100, 2000]


def digest(ids: list[int]) -> str:
    """A short hash of one request's output ids."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]


class Ours:
    """epd-serve's offline ``LLM``."""

    def __init__(self, model: str, threads: int, config: dict | None = None) -> None:
        import torch

        from services import LLM, SamplingParams

        torch.set_num_threads(threads)
        self._params = SamplingParams
        kwargs = {
            "kv_cache_memory_mb": KV_GIB * 1024,
            "max_num_seqs": 256,
            "enable_prefix_caching": True,
            **(config or {}),
        }
        self.llm = LLM(model, **kwargs)
        eng = self.llm.engine
        self.config = (
            f"backend {eng.backend.name}, step budget {eng.step_tokens} tokens, "
            f"extra {config or {}}"
        )

    def run(self, prompts: list[list[int]], outputs: list[int]) -> list[list[int]]:
        """Output ids of one ``generate`` call, greedy, each to its own max_tokens."""
        assert self.llm.engine.block_manager.reset_prefix_cache()
        params = [self._params(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]


class Vllm:
    """vLLM's offline ``LLM`` (CPU build), prompts as token ids, torch.compile at load."""

    def __init__(self, model: str, threads: int, config: dict | None = None) -> None:
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        kwargs = {
            "dtype": "float32",
            "skip_tokenizer_init": True,
            "max_model_len": 2048,
            "enable_prefix_caching": True,
            "seed": 0,
        }
        self.llm = LLM(model=model, **(kwargs | (config or {})))
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.config = (
            f"max_num_batched_tokens {sched.max_num_batched_tokens}, "
            f"max_num_seqs {sched.max_num_seqs}"
        )

    def run(self, prompts: list[list[int]], outputs: list[int]) -> list[list[int]]:
        """Output ids of one ``generate`` call, greedy, each to its own max_tokens."""
        self.llm.reset_prefix_cache()
        params = [
            self._params(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in outputs
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def serve(system, proto) -> None:
    """Answer commands from stdin until it closes."""
    for line in sys.stdin:
        cmd = json.loads(line)
        w = workloads.build(cmd["workload"])
        t0 = time.perf_counter()
        ids = system.run(w.prompts, w.outputs)
        dt = time.perf_counter() - t0
        tokens = sum(len(i) for i in ids)
        reply = {"seconds": dt, "tokens": tokens, "digest": [digest(i) for i in ids]}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", choices=["ours", "vllm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", type=json.loads, default={}, help="extra LLM(...) arguments")
    args = ap.parse_args()
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the systems (and their child processes) print goes to stderr
    system = (Ours if args.system == "ours" else Vllm)(args.model, args.threads, args.config)
    # Warm-up over the prompt lengths the workloads use (first-use costs: oneDNN
    # primitives, vLLM's compiled shapes), so that a single round is already warm.
    system.run(workloads.random_prompts(random.Random(0), WARM_LENGTHS), [4] * len(WARM_LENGTHS))
    proto.write(json.dumps({"ready": system.config}) + "\n")
    proto.flush()
    serve(system, proto)


if __name__ == "__main__":
    main()
