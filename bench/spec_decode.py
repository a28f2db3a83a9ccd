"""Speculative decoding benchmark: n-gram, EAGLE-3 and P-EAGLE against plain decoding.

    python bench/spec_decode.py [--prompts 8] [--new 96] [--rounds 2] [--json out.json]

Builds (first run only, cached under ~/.cache/epd-serve/spec-bench/) a small Llama trained
on the Python standard library's sources and an EAGLE-3 and a P-EAGLE head trained on its
hidden states (bench/_spec_train.py, bench/_spec_heads.py), then on held-out stdlib files:

1. offline acceptance: each proposer's drafts against the target's greedy continuation
   (bench/_spec_offline.py), mean acceptance length and acceptance per draft position;
2. end to end: the engine (``LLM``) with and without ``speculative_config``, greedy, at
   batch 1 and batch 8, every configuration timed in turn within each round (the machine
   is shared: ratios come from interleaved runs); tokens/s, speed-up, the engine's own
   mean acceptance length, and the cost of one speculative step (draft + verify) and of
   the verification alone against one plain decode step. Outputs are checked identical
   to plain decoding's (lossless).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spec_engine import run_engine_suite  # noqa: E402
from _spec_heads import HeadRecipe, build_pool, new_head, train_head  # noqa: E402
from _spec_offline import references, replay  # noqa: E402
from _spec_train import CACHE, build_target, stdlib_files  # noqa: E402

from services.engine.spec.eagle import Eagle3Proposer  # noqa: E402
from services.models.eagle3 import Eagle3Head  # noqa: E402

log = logging.getLogger("bench.spec")
KS = (3, 5, 7)
AUX_IDS = (2, 4, 6)  # outputs of target layers 1, 3, 5 (low, middle, last of 6)


def build_heads(target_dir: Path, stream: torch.Tensor, r: HeadRecipe = HeadRecipe()) -> dict:
    """The cached EAGLE-3 and P-EAGLE head directories (trained on first use)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    dirs = {kind: CACHE / kind for kind in ("eagle3", "peagle")}
    todo = [kind for kind, d in dirs.items() if not (d / "epd_spec_bench.json").exists()]
    if not todo:
        return dirs
    target = LlamaForCausalLM.from_pretrained(str(target_dir)).eval()
    mask_id = AutoTokenizer.from_pretrained(str(target_dir)).mask_token_id
    t0 = time.perf_counter()
    pool = build_pool(target, stream, AUX_IDS, r)
    log.info(
        "head training pool: %d sequences (%.0f s)", len(pool.tokens), time.perf_counter() - t0
    )
    for kind in todo:
        t0 = time.perf_counter()
        head = train_head(new_head(target, kind, AUX_IDS, mask_id, target_dir), pool, r)
        head.save_pretrained(dirs[kind])
        marker = dirs[kind] / "epd_spec_bench.json"
        marker.write_text(json.dumps({"seconds": time.perf_counter() - t0}))
    return dirs


def held_out_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``length``-token prompts from ``n`` held-out stdlib files (from a third of the way in,
    at a line start), none seen in training."""
    _, held = stdlib_files()
    prompts = []
    for path in held:
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok("".join(lines[len(lines) // 3 :]), add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def offline_table(target_dir: Path, heads: dict, prompts, new: int) -> list[dict]:
    """Mean acceptance length per method and k, from the replay (no engine)."""
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(str(target_dir)).eval()
    refs = references(target, prompts, new, AUX_IDS)
    rows = []
    for method, make in _proposers(heads, target.config).items():
        for k in KS:
            acc = replay(make(), refs, k)
            rows.append(
                {
                    "method": method,
                    "k": k,
                    "mean_acceptance_length": round(acc.mean_length, 3),
                    "acceptance_by_position": acc.by_position(),
                }
            )
            log.info("offline %-8s k=%d  mean acceptance length %.2f", method, k, acc.mean_length)
    return rows


def _proposers(heads: dict, target_config) -> dict:
    from services.engine.spec.ngram import NgramProposer

    def eagle(kind: str, parallel: bool):
        return lambda: Eagle3Proposer(Eagle3Head.from_pretrained(heads[kind]), parallel)

    return {
        "ngram": lambda: NgramProposer(1, 4),
        "eagle3": eagle("eagle3", False),
        "p-eagle": eagle("peagle", True),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (batch 8 uses all)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    ap.add_argument("--offline-only", action="store_true", help="skip the engine runs")
    ap.add_argument("--build-only", action="store_true", help="build the cached models, stop")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)  # the recipe's figures were taken this way (shared 2-core box)
    target_dir, stream = build_target()
    heads = build_heads(target_dir, stream)
    if args.build_only:
        return 0
    from transformers import AutoTokenizer

    prompts = held_out_prompts(
        AutoTokenizer.from_pretrained(str(target_dir)), args.prompts, args.prompt_len
    )
    report = {
        "target": str(target_dir),
        "heads": {k: str(v) for k, v in heads.items()},
        "offline": offline_table(target_dir, heads, prompts, args.new),
    }
    if not args.offline_only:
        report["engine"] = run_engine_suite(target_dir, heads, prompts, args.new, args.rounds, KS)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
