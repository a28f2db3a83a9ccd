"""What the tile kernel of prefill attention buys our offline ``LLM``, before against after.

    flock /tmp/bench.lock taskset -c 0 python bench/prefill_attention_e2e.py --rounds 2

One process, one ``LLM`` on the shared checkpoint of ``vs_vllm.py`` (docs/serving-peers.md),
1 thread, the workloads of ``_vs_vllm_workloads.py`` (default: ``long``, 16 x 2000 -> 32,
and ``mixed``, 256 requests U[32,512] -> U[16,256]). Each round runs every workload twice,
the order swapping every round: "before" plans attention as the backend did before the tile
kernel (prefill rows one at a time up to 1,024 tokens of context, SDPA beyond), "after" with
the current limits of ``services/kernels/cpu_attention.py``. Prints output tok/s per round
and the ratio of the bests, and checks that both give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import _vs_vllm_workloads as workloads  # noqa: E402
from _peers_checkpoint import text_checkpoint  # noqa: E402

from services import LLM, SamplingParams  # noqa: E402
from services.kernels import cpu_attention  # noqa: E402

NAMES = ("TILE_MIN_ROWS", "ROW_EXTEND_MAX")
BEFORE = (1 << 30, 1024)  # no tiles; per row up to 1,024 tokens, SDPA beyond
AFTER = tuple(getattr(cpu_attention, n) for n in NAMES)


def run(llm: LLM, w: workloads.Workload, limits: tuple[int, ...]) -> tuple[float, list]:
    """(output tok/s, token ids) of one generate call under these planning limits."""
    for n, v in zip(NAMES, limits, strict=True):
        setattr(cpu_attention, n, v)
    assert llm.engine.block_manager.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return w.output_tokens / dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="long,mixed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/peers/ckpt"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        str(text_checkpoint(args.cache_dir)),
        kv_cache_memory_mb=1024,
        max_num_seqs=256,
        enable_prefix_caching=True,
    )
    print(f"limits {dict(zip(NAMES, AFTER, strict=True))}")
    for name in args.workloads.split(","):
        w = workloads.build(name)
        rates: dict[str, list[float]] = {"before": [], "after": []}
        ids: dict[str, list] = {}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                rate, ids[side] = run(llm, w, BEFORE if side == "before" else AFTER)
                rates[side].append(rate)
        same = sum(a == b for a, b in zip(ids["before"], ids["after"], strict=True))
        fmt = {k: " ".join(f"{x:.1f}" for x in v) for k, v in rates.items()}
        print(
            f"{name} ({w.title}): before {fmt['before']} tok/s, after {fmt['after']} tok/s, "
            f"after/before {max(rates['after']) / max(rates['before']):.3f}x (bests); "
            f"{same}/{len(w.prompts)} outputs identical",
            flush=True,
        )


if __name__ == "__main__":
    main()
