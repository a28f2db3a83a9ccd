"""Speculative decoding's figures: drafts verified and accepted, overall and by position.

Kept per engine (``SpecStats``: benchmarks and tests read it) and exported as Prometheus
``epd_spec_*`` counters (services/metrics.py). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.metrics import (
    SPEC_ACCEPTED_BY_POSITION,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS_BY_POSITION,
    SPEC_VERIFICATIONS,
)


@dataclass
class SpecStats:
    """Counts since the engine started."""

    # Request-steps that verified at least one draft.
    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Index i: drafts verified / accepted at draft position i (0 = the first draft).
    drafts_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    # The Prometheus children of each position (``labels`` looked up once, not per step).
    _children: list[tuple] = field(default_factory=list, repr=False, compare=False)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the target's own token."""
        if not self.verifications:
            return 0.0
        return (self.accepted_tokens + self.verifications) / self.verifications

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Per draft position, the fraction of verified drafts there that were accepted."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_by_position, self.drafts_by_position, strict=True)
        ]

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its ``num_drafts`` drafts."""
        if num_drafts <= 0:
            return
        self.verifications += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        SPEC_VERIFICATIONS.inc()
        SPEC_DRAFT_TOKENS.inc(num_drafts)
        SPEC_ACCEPTED_TOKENS.inc(num_accepted)
        while len(self.drafts_by_position) < num_drafts:
            pos = str(len(self.drafts_by_position))
            self.drafts_by_position.append(0)
            self.accepted_by_position.append(0)
            self._children.append(
                (SPEC_DRAFTS_BY_POSITION.labels(pos), SPEC_ACCEPTED_BY_POSITION.labels(pos))
            )
        for i in range(num_drafts):
            self.drafts_by_position[i] += 1
            self._children[i][0].inc()
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1
            self._children[i][1].inc()
