"""N-gram proposer: longest suffix first, most recent occurrence, loops extended to k."""

from __future__ import annotations

import pytest

from services.engine.spec_ngram import NgramProposer
from services.engine.spec_proposer import ProposeInput, Proposer


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
