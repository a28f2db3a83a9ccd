"""Batch-1 n-gram speculative decoding speed-up on a repetitive prompt (a quick check;
bench/spec_decode.py is the full benchmark).

Two engines on one checkpoint, without and with ``{"method": "ngram"}``, decode the same
greedy request in turns (interleaved, so load drifts hit both alike); prints tokens/s of
each, the ratio and the mean acceptance length, and checks the tokens are identical.

    python -m bench.spec_ngram_quick --model DIR [--k 4] [--tokens 256] [--rounds 5]
        [--threads N] [--random-prompt N]

On a loaded shared box use ``--threads 1``: torch's OpenMP team then stops spinning
against other processes (a [5, 128] x [128, 384] matmul took 38 ms on 2 threads at load
16, 0.03 ms on one), which hits the verify step's multi-row matmuls, not the native
batch-1 decode kernels.

The prompt is a piece of Python source written twice: a model that learned to copy
continues it with a third copy, which prompt lookup drafts exactly. ``--random-prompt N``
instead feeds N random token ids (seed 0), for a checkpoint without a real tokenizer: a
random-weight model's greedy continuation falls into runs of one repeated token, which
prompt lookup drafts too (the peers checkpoint of docs/serving-peers.md, a weight-bound
56 M-parameter Llama).
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

import torch

from services.llm import LLM
from services.sampling_params import SamplingParams


def _prompt(llm: LLM, random_ids: int) -> list[int]:
    if random_ids:
        rng, vocab = random.Random(0), llm.engine.model.config.vocab_size
        return [rng.randrange(3, vocab) for _ in range(random_ids)]
    text = inspect.getsource(statistics.median)
    return llm.tokenizer.encode(text + "\n\n" + text, add_special_tokens=False)


def _run(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved runs of each")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--random-prompt", type=int, default=0, help="N random ids as the prompt")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    plain = LLM(args.model, device="cpu", num_kv_blocks=256)
    spec = LLM(args.model, device="cpu", num_kv_blocks=256, speculative_config=spec_cfg)
    prompt = _prompt(plain, args.random_prompt)
    _run(plain, prompt, 8), _run(spec, prompt, 8)  # warm-up (kernels, allocations)
    times: dict[str, list[float]] = {"plain": [], "ngram": []}
    outs = {}
    for _ in range(args.rounds):
        for name, llm in (("plain", plain), ("ngram", spec)):
            outs[name], seconds = _run(llm, prompt, args.tokens)
            times[name].append(seconds)
    rate = {name: args.tokens / statistics.median(t) for name, t in times.items()}
    stats = spec.engine.spec.stats
    print(
        f"prompt {len(prompt)} tokens, {args.tokens} generated, k={args.k}, "
        f"{args.rounds} interleaved rounds (median)"
    )
    print(f"plain  {rate['plain']:8.1f} tok/s")
    print(f"ngram  {rate['ngram']:8.1f} tok/s   speed-up {rate['ngram'] / rate['plain']:.2f}x")
    print(
        f"mean acceptance length {stats.mean_acceptance_length:.2f}, acceptance by "
        f"position {[round(a, 2) for a in stats.acceptance_by_position()]}"
    )
    print(f"tokens identical: {outs['plain'] == outs['ngram']}")


if __name__ == "__main__":
    main()
