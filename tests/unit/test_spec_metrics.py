"""Speculative decoding's counts (``SpecStats``) and the Prometheus counters they feed:
totals, mean acceptance length and per-position figures agree after a few verifications."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.engine.spec.metrics import SpecStats


def _sample(name: str, position: str | None = None) -> float:
    labels = {"position": position} if position is not None else {}
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_counts_and_counters_agree() -> None:
    names = [
        "epd_spec_verifications_total",
        "epd_spec_draft_tokens_total",
        "epd_spec_accepted_tokens_total",
    ]
    before = [_sample(n) for n in names]
    by_pos = [
        (
            _sample("epd_spec_drafts_by_position_total", str(i)),
            _sample("epd_spec_accepted_by_position_total", str(i)),
        )
        for i in range(4)
    ]
    stats = SpecStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(0, 0)  # no drafts: not a verification
    stats.observe(4, 4)
    assert (stats.verifications, stats.draft_tokens, stats.accepted_tokens) == (3, 9, 6)
    assert stats.mean_acceptance_length == (6 + 3) / 3
    assert stats.drafts_by_position == [3, 3, 2, 1]
    assert stats.accepted_by_position == [2, 2, 1, 1]
    assert stats.acceptance_by_position() == [2 / 3, 2 / 3, 1 / 2, 1.0]
    assert [_sample(n) - b for n, b in zip(names, before, strict=True)] == [3, 9, 6]
    for i, (d0, a0) in enumerate(by_pos):
        assert (
            _sample("epd_spec_drafts_by_position_total", str(i)) - d0 == stats.drafts_by_position[i]
        )
        assert (
            _sample("epd_spec_accepted_by_position_total", str(i)) - a0
            == stats.accepted_by_position[i]
        )
