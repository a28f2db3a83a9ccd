"""The workloads of ``vs_vllm.py``: prompt ids and output lengths, built the same way in
every process (ours and vLLM's interpreter both import this file; it needs only the
standard library).

Prompt ids are drawn from [1000, 30000) of the shared checkpoint's 32,000-entry vocabulary
(no special tokens), so no tokenizer changes what the model sees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ID_LOW, ID_HIGH = 1000, 30000
SHARED_PREFIX = 256  # tokens of the prefix every other request of ``prefix`` starts with


@dataclass(frozen=True)
class Workload:
    """One offline ``generate`` call: ``prompts[i]`` -> ``outputs[i]`` new tokens, greedy."""

    name: str
    title: str
    prompts: list[list[int]]
    outputs: list[int]
    threads: int = 1  # torch / OpenMP threads of both systems

    @property
    def output_tokens(self) -> int:
        """Tokens the call generates (every request runs to its max_tokens: ignore_eos)."""
        return sum(self.outputs)


def random_prompts(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    """One prompt of random ids per length."""
    return [[rng.randrange(ID_LOW, ID_HIGH) for _ in range(n)] for n in lengths]


def mixed_requests(seed: int = 2, n: int = 256) -> tuple[list[list[int]], list[int]]:
    """Prompt lengths U[32, 512] and output lengths U[16, 256], then the prompts, all from
    ``random.Random(seed)`` (the draw order of ``engine_throughput.py``'s W2)."""
    rng = random.Random(seed)
    lens = [rng.randint(32, 512) for _ in range(n)]
    outs = [rng.randint(16, 256) for _ in range(n)]
    return random_prompts(rng, lens), outs


def shared_prefix_requests() -> tuple[list[list[int]], list[int]]:
    """The mixed requests, every other one (50 %) starting with one shared 256-token prefix
    (cut to leave at least 16 own tokens of a shorter prompt)."""
    prompts, outs = mixed_requests()
    shared = random_prompts(random.Random(6), [SHARED_PREFIX])[0]
    for i in range(0, len(prompts), 2):
        k = min(SHARED_PREFIX, len(prompts[i]) - 16)
        prompts[i] = shared[:k] + prompts[i][k:]
    return prompts, outs


def build(name: str) -> Workload:
    """The workload called ``name`` (one of ``NAMES``)."""
    if name == "mixed":
        prompts, outs = mixed_requests()
        return Workload(name, "256 requests, prompts U[32,512] -> U[16,256]", prompts, outs)
    if name == "prefix":
        prompts, outs = shared_prefix_requests()
        return Workload(
            name, "mixed, 50 % shared 256-token prefixes, prefix caching on", prompts, outs
        )
    title, (n, prompt_len, new, seed, threads) = UNIFORM[name]
    prompts = random_prompts(random.Random(seed), [prompt_len] * n)
    return Workload(name, title, prompts, [new] * n, threads)


# name: (title, (prompts, prompt length, new tokens, seed, threads))
UNIFORM = {
    "w64": ("64 x 128 -> 64", (64, 128, 64, 1, 1)),
    "b1": ("1 x 16 -> 256", (1, 16, 256, 3, 1)),
    "long": ("16 x 2000 -> 32", (16, 2000, 32, 4, 1)),
    "decode": ("32 x 64 -> 512", (32, 64, 512, 5, 1)),
    "w64_t2": ("64 x 128 -> 64, 2 threads", (64, 128, 64, 1, 2)),
    "b1_t2": ("1 x 16 -> 256, 2 threads", (1, 16, 256, 3, 2)),
}


NAMES = ("w64", "b1", "mixed", "long", "decode", "prefix", "w64_t2", "b1_t2")
DEFAULT = ("w64", "b1", "mixed", "long", "decode", "prefix", "w64_t2")
