"""The EAGLE-3 / P-EAGLE proposer: drafts equal a from-scratch recomputation of the head
(whatever the batch, however the rows arrived), P-EAGLE runs one head forward per
propose, state is kept per request and freed, bad configurations fail at load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from services.engine.spec.eagle import Eagle3Proposer
from services.engine.spec.proposer import ProposeInput, Proposer
from services.models.eagle3 import Eagle3Head
from services.models.eagle3_config import DraftHeadError
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.eagle_heads import make_eagle_head

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = make_text_checkpoint(tmp_path_factory.mktemp("eagle"), "llama", num_hidden_layers=4)
    return AutoConfig.from_pretrained(d)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("heads")
    half = target.vocab_size // 2
    return {
        kind: make_eagle_head(root, target, kind, draft_vocab=half) for kind in ("eagle3", "peagle")
    }


def _load(heads, target, kind: str, parallel: bool, backend=None) -> Eagle3Proposer:
    return Eagle3Proposer.load(heads[kind], target, "cpu", torch.float32, parallel, backend=backend)


def _request(target, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """A request of n tokens and the target rows of its first n - 1 positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, target.vocab_size, (n,), generator=g).tolist()
    return ids, torch.randn(n - 1, 3 * target.hidden_size, generator=g)


def _reference(head: Eagle3Head, ids: list[int], rows: torch.Tensor, k: int, parallel: bool):
    """Drafts recomputed from scratch over the whole sequence, no cache, no batch."""
    n = len(ids)
    toks, feats = torch.tensor(ids[1:]), head.fuse(rows)
    if parallel:
        toks = torch.cat([toks, toks.new_full((k - 1,), head.cfg.mask_token_id)])
        feats = torch.cat([feats, head.mask_feature().expand(k - 1, -1)])
        out, _, _ = head.step(toks[None], feats[None], torch.arange(1, n + k - 1)[None])
        return head.to_target(head.readout(out[0, n - 2 :])[0].argmax(-1)).tolist()
    drafts = []
    for _ in range(k):
        out, _, _ = head.step(toks[None], feats[None], torch.arange(1, len(toks) + 1)[None])
        logits, feat = head.readout(out[0, -1])
        tok = head.to_target(logits.argmax(-1))
        drafts.append(int(tok))
        toks, feats = torch.cat([toks, tok[None]]), torch.cat([feats, feat[None]])
    return drafts


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize(("kind", "parallel"), [("eagle3", False), ("peagle", True)])
def test_batched_drafts_equal_the_head_recomputed_from_scratch(
    heads, target, kind, parallel, native, request
):
    # Two rounds: the prompt rows, then 2 more rows each, so the second round's batch
    # pads both the kept K/V (lengths 3, 15, 7) and the new rows. native: the head's
    # norms and rotary through the cpu backend (the engine hands its backend over).
    prop = _load(heads, target, kind, parallel, request.getfixturevalue("be") if native else None)
    assert (prop.head._ops is not None) == native
    reqs = [_request(target, n, seed) for seed, n in enumerate((5, 17, 9))]
    rounds = [
        [(ids[:-2], rows[:-2], rows[:-2]) for ids, rows in reqs],  # prompt rows
        [(ids, rows, rows[-2:]) for ids, rows in reqs],  # 2 accepted tokens' rows
    ]
    for reqs_now in rounds:
        got = prop.propose(
            [ProposeInput(f"r{i}", ids, new) for i, (ids, _, new) in enumerate(reqs_now)], K
        )
        with torch.inference_mode():
            want = [_reference(prop.head, ids, rows, K, parallel) for ids, rows, _ in reqs_now]
        assert got == want
        assert all(len(d) == K and all(0 <= t < target.vocab_size for t in d) for d in got)


@pytest.mark.parametrize(("kind", "parallel"), [("eagle3", False), ("peagle", True)])
def test_rows_delivered_in_pieces_draft_as_if_given_at_once(heads, target, kind, parallel):
    # Prefill rows first, then one verify step that accepted 2 drafts (3 rows): the
    # drafted K/V of the first propose must be gone and the committed part reused.
    ids, rows = _request(target, 14, seed=7)
    prop = _load(heads, target, kind, parallel)
    prop.propose([ProposeInput("a", ids[:11], rows[:10])], K)
    got = prop.propose([ProposeInput("a", ids, rows[10:])], K)
    fresh = _load(heads, target, kind, parallel).propose([ProposeInput("a", ids, rows)], K)
    assert got == fresh


def test_rows_from_an_earlier_position_replace_what_was_kept(heads, target):
    # Rows re-delivered from position 5 on (a recompute after a preemption, the first
    # positions a prefix-cache hit) replace the kept entries from there on.
    ids, rows = _request(target, 12, seed=3)
    redone = torch.randn(rows.shape, generator=torch.Generator().manual_seed(9))
    prop = _load(heads, target, "eagle3", False)
    prop.propose([ProposeInput("a", ids, rows)], K)
    got = prop.propose([ProposeInput("a", ids, redone[4:])], K)
    fresh = _load(heads, target, "eagle3", False)
    fresh.propose([ProposeInput("a", ids[:5], rows[:4])], K)
    assert got == fresh.propose([ProposeInput("a", ids, redone[4:])], K)
    assert got != _load(heads, target, "eagle3", False).propose([ProposeInput("a", ids, rows)], K)


def test_peagle_drafts_with_one_head_forward_per_propose(heads, target):
    prop = _load(heads, target, "peagle", True)
    batch = [ProposeInput(f"r{i}", *_request(target, 6 + i, i)) for i in range(8)]
    for k in (3, 7):
        before = prop.forwards
        drafts = prop.propose(batch, k)
        assert prop.forwards - before == 1
        assert [len(d) for d in drafts] == [k] * 8
    auto = _load(heads, target, "eagle3", False)
    auto.propose(batch, 7)
    assert auto.forwards == 7  # EAGLE-3: one per drafted position


def test_state_is_per_request_and_freed(heads, target):
    prop = _load(heads, target, "eagle3", False)
    assert isinstance(prop, Proposer)
    prop.propose([ProposeInput(r, *_request(target, 8, i)) for i, r in enumerate("ab")], K)
    assert sorted(prop.requests) == ["a", "b"]
    prop.free("a")
    prop.free("never-seen")
    assert prop.requests == ("b",)


def test_nothing_to_draft_from_gives_no_drafts(heads, target):
    prop = _load(heads, target, "eagle3", False)
    ids, rows = _request(target, 8, 0)
    empty = torch.zeros(0, rows.shape[1])
    out = prop.propose([ProposeInput("a", ids, None), ProposeInput("b", ids, empty)], K)
    assert out == [[], []]
    assert prop.propose([ProposeInput("c", ids, rows)], 0) == [[]]
    assert prop.forwards == 0


def test_drafts_are_deterministic(heads, target):
    batch = [ProposeInput(f"r{i}", *_request(target, 10, i)) for i in range(3)]
    runs = [_load(heads, target, "peagle", False).propose(batch, K) for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_proposer_reads_layer_outputs_one_below_the_speculators_ids(heads, target):
    assert _load(heads, target, "eagle3", False).aux_layers == (0, 1, 3)  # ids 1, 2, 4


def test_parallel_drafting_needs_a_peagle_head(heads, target):
    with pytest.raises(DraftHeadError, match="peagle"):
        _load(heads, target, "eagle3", True)


def test_a_head_for_another_target_is_refused_at_load(heads, target):
    other = AutoConfig.for_model(
        "llama",
        hidden_size=96,
        vocab_size=target.vocab_size,
        num_hidden_layers=4,
        num_attention_heads=4,
    )
    with pytest.raises(DraftHeadError, match="hidden size"):
        Eagle3Proposer.load(heads["eagle3"], other, "cpu", torch.float32, False)
