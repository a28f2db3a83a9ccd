"""The guards, as signals with actions: PII (allow / redact / block) and jailbreak
(allow / block). A block is a 400 that names the reason; a redaction rewrites the user's
messages before any model (or the semantic cache) sees them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from gateway.semantic_router.jailbreak import heuristic_hit
from gateway.semantic_router.pii import redact
from gateway.semantic_router.state import RouterState


@dataclass
class GuardOutcome:
    """What the guards did to one request."""

    action: str = "allow"  # "allow", "redact" or "block"
    guard: str = ""  # "pii" or "jailbreak" when one acted (or only flagged)
    reason: str = ""  # the block's message; the redacted kinds
    kinds: list[str] = field(default_factory=list)  # PII kinds found
    messages: list[dict] | None = None  # redacted copies
    prompt: str | None = None

    @property
    def header(self) -> str:
        """The x-epd-guard value: ``allow``, ``redact:pii``, ``block:jailbreak`` ..."""
        return "allow" if self.action == "allow" else f"{self.action}:{self.guard}"


def check_pii(state: RouterState, messages: list[dict] | None, prompt: str | None) -> GuardOutcome:
    """Find PII in the user's texts; block, redact (copies) or allow as configured."""
    cfg = state.config.guards.pii
    if not cfg.kinds and not cfg.patterns:
        return GuardOutcome()
    kinds: set[str] = set()
    new_messages = copy.deepcopy(messages) if messages is not None else None
    new_prompt = {"prompt": prompt} if messages is None and prompt is not None else None
    for holder, key in _user_texts(new_messages, new_prompt):
        found = state.pii.find(holder[key])
        if found:
            kinds.update(f.kind for f in found)
            holder[key] = redact(holder[key], found)
    if not kinds:
        return GuardOutcome()
    named = sorted(kinds)
    if cfg.action == "block":
        return GuardOutcome(
            "block",
            "pii",
            f"the request contains personal data ({', '.join(named)}); refused by the PII guard",
            named,
        )
    if cfg.action == "allow":  # found and counted, let through unchanged
        return GuardOutcome("allow", "pii", ", ".join(named), named)
    return GuardOutcome(
        "redact",
        "pii",
        ", ".join(named),
        named,
        new_messages,
        new_prompt["prompt"] if new_prompt else None,
    )


def check_jailbreak_heuristics(state: RouterState, texts: list[str]) -> GuardOutcome:
    """Block on a phrase rule (when the guard is on and heuristics are enabled)."""
    cfg = state.config.guards.jailbreak
    if cfg.action == "allow" or not cfg.heuristics:
        return GuardOutcome()
    hit = heuristic_hit(texts)
    if hit is None:
        return GuardOutcome()
    return GuardOutcome("block", "jailbreak", _jailbreak_message(hit.reason))


def check_jailbreak_similarity(state: RouterState, score: float) -> GuardOutcome:
    """Block when the message is this close to a known attack prompt."""
    cfg = state.config.guards.jailbreak
    if cfg.action == "allow" or score < cfg.threshold:
        return GuardOutcome()
    reason = f"similar-to-known-attack ({score:.2f})"
    return GuardOutcome("block", "jailbreak", _jailbreak_message(reason))


def _jailbreak_message(reason: str) -> str:
    return f"the request looks like a jailbreak or prompt injection ({reason}); refused by the jailbreak guard"


def _user_texts(messages: list[dict] | None, prompt: dict | None):
    """(holder, key) of every user text, so it can be read and replaced in place."""
    if prompt is not None:
        yield prompt, "prompt"
    if messages is None:
        return
    for m in messages:
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            yield m, "content"
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    yield part, "text"
