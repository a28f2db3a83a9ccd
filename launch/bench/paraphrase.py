"""The ``paraphrase`` dataset: seed questions, then their repeats, paraphrases and hard negatives.

The pairs ship in ``paraphrase_pairs.jsonl`` (a copy of the semantic cache's labelled set,
``tests/data/semantic_cache_pairs.jsonl``: rows ``a``, ``b``, ``label`` hit | miss, ``kind``).
A run asks each seed question ``a`` first, then (in a second phase, after every seed has
been answered and stored) one follow-up per seed: the same question again (``repeat``), its
paraphrase ``b`` (label hit) or a hard negative ``b`` (label miss: a different number,
entity, negation...). Each request carries the outcome a right cache gives, so the summary
can count false hits (a negative answered from the cache) and missed hits.
"""

from __future__ import annotations

import json
import random
from functools import cache
from importlib import resources

from launch.bench.datasets import BenchRequest

KINDS = ("repeat", "paraphrase", "negative")
DEFAULT_MIX = "repeat:0.3,paraphrase:0.5,negative:0.2"
PAIRS_FILE = "paraphrase_pairs.jsonl"


@cache
def load_pairs() -> tuple[dict[str, str], ...]:
    """The shipped pairs (read once)."""
    text = resources.files("launch.bench").joinpath(PAIRS_FILE).read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def parse_mix(spec: str) -> dict[str, float]:
    """``"repeat:0.3,paraphrase:0.5,negative:0.2"`` -> weights summing to 1."""
    mix: dict[str, float] = {}
    for item in spec.split(","):
        kind, sep, weight = item.strip().partition(":")
        if not sep or kind not in KINDS:
            raise ValueError(
                f"--paraphrase-mix wants KIND:WEIGHT with KIND in {KINDS}, got {item!r}"
            )
        mix[kind] = float(weight)
        if mix[kind] < 0:
            raise ValueError(f"--paraphrase-mix weights must be >= 0, got {item!r}")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"--paraphrase-mix has no positive weight: {spec!r}")
    return {k: w / total for k, w in mix.items()}


def kind_counts(n: int, mix: dict[str, float]) -> dict[str, int]:
    """``n`` split by the mix, rounded so the counts sum to ``n`` (largest remainders)."""
    exact = {k: n * w for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    by_remainder = sorted(exact, key=lambda k: exact[k] - counts[k], reverse=True)
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def _pick(n: int, mix: dict[str, float], seed: int) -> list[tuple[str, dict[str, str]]]:
    """``n`` (kind, row) pairs with distinct seed questions, in a seeded order."""
    rng = random.Random(seed)
    rows = list(load_pairs())
    rng.shuffle(rows)
    counts = kind_counts(n, mix)
    used: set[str] = set()
    picked: list[tuple[str, dict[str, str]]] = []
    # Rarer pools first, so the plentiful paraphrase rows fill in around them.
    for kind in ("negative", "paraphrase", "repeat"):
        wanted = counts.get(kind, 0)
        pool = [r for r in rows if (r["label"] == "hit") == (kind == "paraphrase")]
        if kind == "repeat":
            pool = rows  # a repeat asks ``a`` twice: any row serves
        for row in pool:
            if wanted == 0:
                break
            if row["a"] not in used:
                used.add(row["a"])
                picked.append((kind, row))
                wanted -= 1
        if wanted:
            raise ValueError(f"the pair set has too few distinct {kind} questions for {n} pairs")
    rng.shuffle(picked)
    return picked


def _ask(text: str, output_len: int, kind: str, expect: str) -> BenchRequest:
    return BenchRequest(
        messages=[{"role": "user", "content": text}],
        max_tokens=output_len,
        prompt_words=len(text.split()),
        kind=kind,
        expect=expect,
    )


def paraphrase_requests(
    n: int, output_len: int, seed: int, mix: str = DEFAULT_MIX
) -> list[BenchRequest]:
    """``n`` requests: ``ceil(n / 2)`` seed questions, then ``floor(n / 2)`` follow-ups."""
    pairs = _pick((n + 1) // 2, parse_mix(mix), seed)
    seeds = [_ask(row["a"], output_len, "seed", "miss") for _, row in pairs]
    follow = []
    for kind, row in pairs[: n // 2]:
        if kind == "repeat":
            follow.append(_ask(row["a"], output_len, "repeat", "hit"))
        elif kind == "paraphrase":
            follow.append(_ask(row["b"], output_len, "paraphrase", "hit"))
        else:
            follow.append(_ask(row["b"], output_len, f"negative/{row['kind']}", "miss"))
    return seeds + follow
