"""N-gram proposer: longest suffix first, most recent occurrence, loops extended to k."""

from __future__ import annotations

import random

import pytest

from services.engine.spec.ngram import NgramProposer
from services.engine.spec.proposer import ProposeInput, Proposer


@pytest.mark.parametrize(
    ("tokens", "k", "drafts"),
    [
        ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, [4, 9, 9]),  # suffix 1 2 3 seen at 0
        ([1, 2, 3, 4, 5], 3, []),  # nothing recurs
        ([5, 6, 7, 8, 5, 6, 0, 8, 6], 2, [0, 8]),  # only "6" recurs: latest at 5
        ([7, 7, 7], 4, [7, 7, 7, 7]),  # a loop of period 1 copies its own drafts
        ([1, 2, 1, 2, 1], 5, [2, 1, 2, 1, 2]),  # period 2
        ([3, 1, 2, 8, 4, 1, 2, 9, 1, 2], 2, [9, 1]),  # most recent occurrence of "1 2"
        ([1, 2, 3, 1, 2, 3], 0, []),
    ],
)
def test_lookup(tokens, k, drafts) -> None:
    assert NgramProposer(1, 3).lookup(tokens, k) == drafts


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # "4 5" recurs at 3 (followed by 6); the 1-gram "5" recurs more recently at 8 (-> 0).
    tokens = [1, 4, 5, 6, 0, 0, 0, 0, 5, 0, 4, 5]
    assert NgramProposer(1, 2).lookup(tokens, 1) == [6]
    assert NgramProposer(1, 1).lookup(tokens, 1) == [0]
    assert NgramProposer(3, 3).lookup(tokens, 1) == []


def test_protocol_and_batch() -> None:
    prop = NgramProposer(1, 4)
    assert isinstance(prop, Proposer) and prop.aux_layers == ()
    batch = [ProposeInput("a", [1, 2, 1], None), ProposeInput("b", [1], None)]
    assert prop.propose(batch, 2) == [[2, 1], []]
    prop.free("a")
    with pytest.raises(ValueError):
        NgramProposer(2, 1)


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule spelled out: the longest suffix n-gram (hi .. lo) that occurred earlier,
    its most recent occurrence, the tokens after it (the drafts extending a loop)."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[s + n + i])
                return ext[len(tokens) :]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_lookup_matches_the_rule_on_random_tokens(seed) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(0, 6)
        want = _reference(tokens, k, lo, hi) if k else []
        assert NgramProposer(lo, hi).lookup(tokens, k) == want, (tokens, k, lo, hi)
