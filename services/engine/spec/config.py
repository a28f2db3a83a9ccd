"""``SpeculativeConfig``: which draft proposer, how many drafts, validated at start-up.

Shaped like vLLM's ``speculative_config``: a dict (or a JSON string, for the CLI's
``--speculative-config``) with ``method`` and ``num_speculative_tokens``. Checks that
need the target model (the head's vocabulary and hidden size) run when the proposer is
built (spec/decoding.py), still at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "eagle3")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding settings (see docs/spec-decode.md)."""

    # "ngram" (prompt lookup, no extra model) or "eagle3" (an EAGLE-3 draft head).
    method: str
    # Drafts proposed per request per step (k): each step verifies up to 1 + k tokens.
    num_speculative_tokens: int
    # eagle3: the draft head's checkpoint directory (Speculators format).
    model: str | None = None
    # ngram: the shortest and longest suffix n-gram looked up earlier in the request.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # eagle3: P-EAGLE, all k drafts from one forward of the head (else k forwards).
    parallel_drafting: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an int in 1..16, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.method == "eagle3":
            self._check_head_dir()
        elif self.model is not None or self.parallel_drafting:
            raise ValueError("model and parallel_drafting apply to method 'eagle3' only")

    def _check_head_dir(self) -> None:
        if not self.model:
            raise ValueError("speculative method 'eagle3' needs 'model': the head's directory")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"draft head {self.model!r}: no config.json there")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None):
        """A config from a dict, a JSON object string, or None / "" (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)

    def __str__(self) -> str:
        # JSON, so that `epd up` hands it to its services as EPD_SPECULATIVE_CONFIG.
        return self.to_json()

    def to_json(self) -> str:
        """The JSON form ``parse`` reads (what ``epd up`` passes to its services)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)
