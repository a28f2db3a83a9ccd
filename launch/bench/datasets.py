"""Benchmark datasets generated in code (no downloads): ``random`` and ``chat``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DATASETS = ("random", "chat")

# Common short English words: most tokenizers map each (with its leading space) to one token,
# so a prompt of N words is about N tokens.
_WORD_TEXT = (
    "the of and to in is was for on are with as by at be this from or have an they which "
    "one you had not but what all were when we there can more if no out so said time about "
    "up into than them only other new some could these two may first then do any like my "
    "now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three"
)
WORDS = tuple(_WORD_TEXT.split())

_TOPICS = (
    "gardening",
    "sailing",
    "bread baking",
    "chess openings",
    "bird watching",
    "bicycle repair",
    "star gazing",
    "coffee brewing",
    "rock climbing",
    "pottery",
)
_QUESTIONS = (
    "What should a beginner know about {t}?",
    "Which tools do I need to start with {t}?",
    "What is the most common mistake people make in {t}?",
    "How much time per week does {t} take to get good at?",
    "Can you suggest a first small project for {t}?",
)
_ANSWERS = (
    "Start small, keep notes, and repeat the basics until they feel easy.",
    "A few simple tools are enough at first; buy better ones once you know what you miss.",
    "Most people rush; slowing down and watching someone experienced helps a lot.",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: chat messages (the completions endpoint joins their text).

    With ``prompt_ids`` the request is a completions prompt of those token ids instead, so
    servers with different tokenizers see the same prompt tokens.
    """

    messages: list[dict[str, Any]]
    max_tokens: int
    prompt_words: int  # words (or token ids) in the prompt: the input length without a tokenizer
    prompt_ids: tuple[int, ...] | None = None  # sent as ``prompt: [ids]`` to /completions
    kind: str | None = None  # paraphrase: seed | repeat | paraphrase | negative/<why>
    expect: str | None = None  # paraphrase: "hit" or "miss", what a right cache answers
    images: int = 0  # random-mm: image slots in the request
    image_repeats: int = 0  # random-mm: slots holding an image already sent

    @property
    def prompt(self) -> str:
        """The messages' text as one completion prompt (image parts are left out)."""
        texts = []
        for m in self.messages:
            content = m["content"]
            if isinstance(content, list):
                content = " ".join(p["text"] for p in content if p.get("type") == "text")
            texts.append(content)
        return "\n".join(texts)


def draw_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_ids: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    """``n`` prompts of about ``input_len`` words; each asks for about ``output_len`` tokens.

    With ``token_ids=(lo, hi)`` each prompt is ``input_len`` token ids uniform in
    ``[lo, hi)`` instead of words (sent to /completions as ``prompt: [ids]``).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if token_ids is not None and not 0 <= token_ids[0] < token_ids[1]:
        raise ValueError(f"token id range must satisfy 0 <= min < max, got {token_ids}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = draw_length(rng, input_len, range_ratio)
        max_tokens = draw_length(rng, output_len, range_ratio)
        if token_ids is not None:
            ids = tuple(rng.randrange(*token_ids) for _ in range(length))
            out.append(
                BenchRequest(
                    messages=[], max_tokens=max_tokens, prompt_words=length, prompt_ids=ids
                )
            )
            continue
        words = [rng.choice(WORDS) for _ in range(length)]
        out.append(
            BenchRequest(
                messages=[{"role": "user", "content": " ".join(words)}],
                max_tokens=max_tokens,
                prompt_words=len(words),
            )
        )
    return out


def chat_requests(n: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``n`` synthetic conversations of 1-3 turns ending in a user question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(_TOPICS)
        messages: list[dict[str, str]] = []
        for _turn in range(rng.randint(0, 2)):
            messages.append({"role": "user", "content": rng.choice(_QUESTIONS).format(t=topic)})
            messages.append({"role": "assistant", "content": rng.choice(_ANSWERS)})
        messages.append({"role": "user", "content": rng.choice(_QUESTIONS).format(t=topic)})
        words = sum(len(m["content"].split()) for m in messages)
        out.append(BenchRequest(messages=messages, max_tokens=output_len, prompt_words=words))
    return out


def make_requests(
    name: str,
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_ids: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    """The dataset ``name`` with ``n`` requests, deterministic for a seed."""
    if name == "random":
        return random_requests(n, input_len, output_len, range_ratio, seed, token_ids)
    if name == "chat":
        return chat_requests(n, output_len, seed)
    raise ValueError(f"unknown dataset {name!r} (have: {', '.join(DATASETS)})")
