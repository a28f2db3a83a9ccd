"""The jailbreak guard: phrase heuristics, and similarity to known attack prompts.

The heuristics catch the classic shapes whatever their wording around them: orders to
drop earlier instructions, requests for the hidden system prompt, role-play overrides
("you are DAN", "developer mode") and base64 blobs that hide plain-language text. They
are written against *the assistant's* instructions ("ignore your/the previous
instructions"), so a user revising their own request ("ignore my previous message") or
asking about the topic ("what is a system prompt?") passes. Similarity to the shipped set
(data/jailbreak_prompts.txt, plus the config's own) catches paraphrases.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from importlib import resources

import numpy as np

_DROP = r"(?:ignore|disregard|forget|override|bypass|drop)"
_THEIR = r"(?:all\s+|any\s+)?(?:of\s+)?(?:your|the|these|those|prior|previous|above|earlier|preceding|original)"
_RULES = r"(?:\s+\w+){0,2}?\s+(?:instructions?|rules|guidelines|directions|prompts?|polic(?:y|ies)|restrictions|programming|training|settings|filters|safeguards)"
_NO_LIMITS = (
    r"(?:(?:with )?no (?:content )?(?:restrictions|limits|rules|filters|morals|ethics|"
    r"guidelines|polic(?:y|ies))|without (?:any )?(?:restrictions|limits|rules|filters|"
    r"morals|ethics)|never refuses?|unrestricted|unfiltered|uncensored|jailbroken|"
    r"unaligned|never aligned|do anything now|DAN\b)"
)
HEURISTICS: tuple[tuple[str, re.Pattern], ...] = (
    ("ignore-instructions", re.compile(rf"\b{_DROP}\s+{_THEIR}{_RULES}\b", re.I)),
    # "Disregard the above and instead ...": the earlier text dropped for a new order.
    (
        "ignore-above",
        re.compile(
            rf"\b{_DROP}\s+(?:all\s+|everything\s+)?(?:of\s+)?(?:the\s+)?(?:above|previous|prior)"
            r"(?:\s+\w+)?[\s,.;:]+(?:and\s+)?(?:instead|now|then)\b",
            re.I,
        ),
    ),
    (
        "reveal-system-prompt",
        re.compile(
            r"\b(?:reveal|print|output|repeat|show|leak|tell me)\b[^.?!]{0,40}?\b(?:system prompt|"
            r"hidden instructions|initial instructions|secret instructions|instructions you were given)",
            re.I,
        ),
    ),
    (
        "role-play-override",
        re.compile(
            r"\b(?:you are|you're|act as|pretend (?:to be|you are|you have)|roleplay as|simulate|"
            rf"play the role of|answer as)\b[^.?!]{{0,60}}?\b{_NO_LIMITS}",
            re.I,
        ),
    ),
    (
        "rules-lifted",
        re.compile(
            r"\b(?:rules|restrictions|guidelines|filters|safety (?:settings|filters|training)|"
            r"content polic(?:y|ies)|system prompt|instructions)\s+(?:were|are|have been|has been|is)\s+(?:now\s+)?"
            r"(?:lifted|removed|disabled|off|void|suspended)\b",
            re.I,
        ),
    ),
    (
        "mode-switch",
        re.compile(
            r"\b(?:enable|enter|activate|switch to|you are (?:now )?in)\s+(?:developer|god|jailbreak|dan|"
            r"maintenance|unrestricted)\s+mode\b",
            re.I,
        ),
    ),
)
_B64 = re.compile(r"(?<![A-Za-z0-9+/=])[A-Za-z0-9+/]{40,}={0,2}(?![A-Za-z0-9+/=])")


@dataclass(frozen=True)
class JailbreakHit:
    """Why a message is taken for an attack."""

    reason: str  # a heuristic's name, "base64-text" or "similar-to-known-attack"
    score: float = 1.0  # the cosine, for the similarity signal


def hidden_text(blob: str) -> str | None:
    """The plain-language text a base64 blob decodes to, if it is that (binary data,
    JSON and keys are not: fewer than 80 % letters and spaces)."""
    try:
        raw = base64.b64decode(blob + "=" * (-len(blob) % 4), validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    plain = sum(c.isalpha() or c == " " for c in text)
    return text if len(text) >= 20 and plain >= 0.8 * len(text) and " " in text else None


def heuristic_hit(texts: list[str]) -> JailbreakHit | None:
    """The first heuristic that fires on any of the texts (base64 blobs are decoded and
    checked too: hidden text at all is a hit, a hidden instruction names its rule)."""
    for text in texts:
        for name, rx in HEURISTICS:
            if rx.search(text):
                return JailbreakHit(name)
        for m in _B64.finditer(text):
            inner = hidden_text(m.group())
            if inner is not None:
                below = heuristic_hit([inner])
                return JailbreakHit(f"base64-{below.reason}" if below else "base64-text")
    return None


def shipped_prompts() -> list[str]:
    """The attack prompts that ship with epd-serve."""
    text = resources.files("gateway.semantic_router").joinpath("data/jailbreak_prompts.txt")
    lines = text.read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


class AttackIndex:
    """Unit vectors of known attack prompts; the nearest one's cosine to a message."""

    def __init__(self, vectors: np.ndarray):
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [n, dim]

    def nearest(self, vec: np.ndarray) -> float:
        if not len(self.vectors):
            return 0.0
        return float(np.max(self.vectors @ vec))
