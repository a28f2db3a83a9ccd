"""The workloads of ``serving_peers.py``: ``epd bench serve`` flags per case, per group."""

from __future__ import annotations

from dataclasses import dataclass

GROUPS = ("random", "tools", "paraphrase", "mm")
# epd-agg-asyncio: epd-agg on asyncio's own loop (uvloop's share; only when named).
TEXT_SYSTEMS = ("epd-agg", "epd-disagg", "vllm", "llama.cpp", "epd-agg-asyncio")


@dataclass(frozen=True)
class Case:
    """One workload setting: a label and the ``epd bench serve`` flags that make it."""

    label: str
    flags: tuple[str, ...]
    systems: tuple[str, ...]  # which systems run it (names of ``_peers_servers.System``)

    @property
    def reference(self) -> str:
        """The system every other one is compared with in the case's table (the first)."""
        return self.systems[0]


def random_case(concurrency: int, prompts: int) -> Case:
    """128 prompt token ids -> 64 tokens (ignore_eos) at a concurrency cap."""
    flags = (
        "--dataset",
        "random",
        "--random-token-ids",
        "--random-input-len",
        "128",
        "--random-output-len",
        "64",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--warmup",
        str(min(concurrency, 8)),
    )
    return Case(f"random c{concurrency}", flags, TEXT_SYSTEMS)


def random_cases(quick: bool) -> list[Case]:
    """Concurrency 1, 8 and 64 (requests: enough for a few batches at each, and at
    concurrency 1 for a steady median: 8 requests' TTFT p50 moved by ~10 % between
    rounds)."""
    if quick:
        return [random_case(1, 3), random_case(8, 12), random_case(64, 48)]
    return [random_case(1, 16), random_case(8, 32), random_case(64, 64)]


def paraphrase_cases(quick: bool) -> list[Case]:
    """The shipped pair set, cache on against off: the seed questions are the warm-up
    (answered and stored, not measured), the follow-ups (repeats / paraphrases / hard
    negatives) are measured; a fresh ``user`` (the cache's tenant) each round and system,
    so no round finds the previous one's answers. Measuring the seeds too would time a
    cold server: on the first 80 requests after start-up a miss's TTFT was twice what it
    was on the next 80 (39.7 against 19.3-20.7 ms, the demo model, 2026-12-02).

    Twice: on the demo model (a toy: ~1.5 ms a token, so a miss is cheap and the ratio
    small) and on the shared Llama of peers.md (the comparisons' checkpoint: a miss costs
    what a 512-wide, 8-layer fp32 model costs), there with the demo's WordPiece tokenizer:
    its own WordLevel one reads every English word as ``<unk>``, and questions that are the
    same ids are rightly exact hits of one another, negatives included."""
    n = "20" if quick else "80"
    flags = (
        "--dataset",
        "paraphrase",
        "--num-prompts",
        n,
        "--warmup",
        n,
        "--random-output-len",
        "32",
        "--max-concurrency",
        "4",
        "--user",
        "peers-{run}",
    )
    return [
        Case("paraphrase, demo model", flags, ("epd-cache-on", "epd-cache-off")),
        Case("paraphrase, shared llama", flags, ("llama-cache-on", "llama-cache-off")),
    ]


def mm_cases(quick: bool) -> list[Case]:
    """224 px PNGs (the tower's input size), 0 % and 80 % reuse, 1 and 4 per request;
    goodput under TTFT 5 s and TPOT 200 ms (1-core figures: the SLO only ranks the two)."""
    cases = []
    for per_request, prompts in ((1, 24), (4, 8)):
        for reuse in (0.0, 0.8):
            flags = (
                "--dataset",
                "random-mm",
                "--mm-images-per-request",
                str(per_request),
                "--image-repeat-ratio",
                str(reuse),
                "--mm-image-size",
                "224x224",
                "--random-input-len",
                "32",
                "--random-output-len",
                "16",
                "--num-prompts",
                str(prompts // (4 if quick else 1) or 2),
                "--max-concurrency",
                "4",
                "--warmup",
                "1",
                "--goodput",
                "ttft:5000",
                "tpot:200",
            )
            label = f"mm {per_request} img, {reuse:.0%} reuse"
            cases.append(Case(label, flags, ("epd-disagg", "epd-agg")))
    return cases


def cases_for(group: str, quick: bool) -> list[Case]:
    """The cases of ``group`` (``tools`` has its own runner)."""
    if group == "random":
        return random_cases(quick)
    if group == "paraphrase":
        return paraphrase_cases(quick)
    if group == "mm":
        return mm_cases(quick)
    return []
