"""Speculative decoding in the scheduler: drafts count against the budget, take block
slots, and rejected ones are rolled back exactly (exact block ids, hashes, ref counts).

A fake "model" decides how many drafts are accepted; ``verify`` returns what the runner
would emit: the accepted drafts, then the target's own token.
"""

from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.scheduler_config import SchedulerConfig
from services.engine.scheduler_output import SchedulerOutput
from services.sampling_params import SamplingParams

EOS = 2
BS = 4  # tokens per block


def make(num_blocks: int = 16, **config: object) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=64, **config)
    return Scheduler(cfg, BlockManager(num_blocks, BS))


def request(rid: str, n: int = 6, **params: object) -> Request:
    params.setdefault("max_tokens", 20)
    return Request(rid, list(range(100, 100 + n)), SamplingParams(**params), eos_token_ids=(EOS,))


def prefill(sched: Scheduler, *reqs: Request, first: int = 50) -> None:
    """Admit the requests and compute their prompts in one step; each samples ``first``."""
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert all(item.sample for item in out.scheduled) and len(out.scheduled) == len(reqs)
    sched.update_from_tokens(out, {req.request_id: [first] for req in reqs})


def verify(sched: Scheduler, accept: dict[str, int], bonus: int = 60):
    """One step; request r accepts its first ``accept[r]`` drafts, then emits ``bonus``."""
    out = sched.schedule()
    sampled = {}
    for item in out.scheduled:
        if item.sample:
            n = accept.get(item.request_id, 0)
            sampled[item.request_id] = item.draft_token_ids[:n] + [bonus]
    finished, kept = sched.update_from_tokens(out, sampled)
    return out, finished, kept


def hashed_blocks(bm: BlockManager) -> list[int]:
    return [b for b in range(bm.num_blocks) if bm.block_hash(b) is not None]


def test_drafts_take_slots_and_rejected_ones_roll_back() -> None:
    sched, req = make(), request("a")
    bm = sched.block_manager
    prefill(sched, req)
    assert req.block_ids == [0, 1] and req.num_computed_tokens == 6
    req.spec_token_ids = [11, 12, 13, 14]
    out, finished, kept = verify(sched, {"a": 1})
    item = out.scheduled[0]
    # The last known token (position 6) and 4 drafts: positions 6..10, three blocks.
    assert (item.num_new_tokens, item.start, item.draft_token_ids) == (5, 6, [11, 12, 13, 14])
    assert out.total_num_tokens == 5 and not finished and kept == {"a": [11, 60]}
    # Positions 6 and 7 (last token, accepted draft) computed; block 2 held only rejects.
    assert req.output_token_ids == [50, 11, 60] and req.num_computed_tokens == 8
    assert req.block_ids == [0, 1] and bm.free_block_ids[0] == 2 and bm.ref_count(2) == 0
    assert hashed_blocks(bm) == [0, 1] and req.spec_token_ids == []
    # The next plain step takes block 2 again, as a run without drafts would have.
    out, _, kept = verify(sched, {})
    assert out.scheduled[0].num_new_tokens == 1 and req.block_ids == [0, 1, 2]
    assert kept == {"a": [60]}


def test_no_block_is_hashed_over_a_rejected_draft() -> None:
    sched, req = make(), request("a")
    bm = sched.block_manager
    prefill(sched, req)
    req.spec_token_ids = [11, 12, 13, 14, 15, 16, 17, 18]  # positions 7..14: blocks 1..3
    out, _, kept = verify(sched, {"a": 0})
    assert out.scheduled[0].num_new_tokens == 9 and kept == {"a": [60]}
    # Block 1 (positions 4..7) was written full, but position 7 held a rejected draft.
    assert req.num_computed_tokens == 7 and req.block_ids == [0, 1]
    assert hashed_blocks(bm) == [0] and bm.free_block_ids[:2] == [2, 3]
    verify(sched, {})  # position 7 now computed from the accepted token 60
    assert hashed_blocks(bm) == [0, 1]
    expected = bm.cached_block(req.block_hashes[1])
    assert expected == 1 and req.all_token_ids[4:8] == [104, 105, 50, 60]


def test_same_blocks_and_hashes_as_a_run_without_drafts() -> None:
    """Emitting the same tokens with and without drafts leaves the same pool."""
    truth = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 61, 62]
    pools = []
    for speculate in (False, True):
        sched, req = make(), request("a", max_tokens=len(truth))
        prefill(sched, req, first=truth[0])
        while sched.has_unfinished():
            n = req.num_output_tokens
            if speculate:  # two right drafts, then a wrong one, within max_tokens
                req.spec_token_ids = (truth[n : n + 2] + [999])[: len(truth) - n - 1]
            out = sched.schedule()
            drafts = out.scheduled[0].draft_token_ids
            good = [d for d, t in zip(drafts, truth[n:], strict=False) if d == t]
            emitted = good + [truth[n + len(good)]]
            sched.update_from_tokens(out, {"a": emitted})
        bm = sched.block_manager
        assert req.output_token_ids == truth
        pools.append((bm.free_block_ids, hashed_blocks(bm), req.block_hashes))
    assert pools[0] == pools[1]


def test_drafts_count_against_the_step_budget() -> None:
    sched = make()
    a, b = request("a"), request("b")
    prefill(sched, a, b)
    sched.config.max_num_batched_tokens = 8
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13, 14, 15], [21, 22, 23]
    out = sched.schedule()
    # a: 1 + 5 = 6 tokens; b gets what is left: its token and one draft.
    assert [(s.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [
        ("a", 6, [11, 12, 13, 14, 15]),
        ("b", 2, [21]),
    ]
    assert out.total_num_tokens == 8


def test_drafts_dropped_rather_than_preempting() -> None:
    sched = make(num_blocks=4)
    a, b = request("a", 7, max_tokens=5), request("b", 7, max_tokens=5)
    prefill(sched, a, b)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    a.spec_token_ids = [11, 12]  # positions 8, 9 need a fifth block: none free
    out, _, kept = verify(sched, {"a": 2})
    assert [(s.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [
        ("a", 1, []),
        ("b", 1, []),
    ]
    assert not out.preempted_ids and kept == {"a": [60], "b": [60]}


def test_preemption_clears_drafts() -> None:
    sched = make(num_blocks=5)
    a, b = request("a", 8, max_tokens=5), request("b", 8, max_tokens=5)
    prefill(sched, a, b)  # a: [0, 1], b: [2, 3] (each 8 tokens + 1 sampled)
    a.spec_token_ids, b.spec_token_ids = [11], [21, 22, 23, 24]
    out = sched.schedule()
    # a takes block 4 for position 8 and its draft; b has no room even without drafts.
    assert out.preempted_ids == ["b"] and b.spec_token_ids == []
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == []
    assert [(s.request_id, s.draft_token_ids) for s in out.scheduled] == [("a", [11])]


@pytest.mark.parametrize(
    ("params", "accept", "kept", "status"),
    [
        ({}, [11, EOS, 13], [11, EOS], RequestStatus.FINISHED_STOPPED),
        ({"max_tokens": 3}, [11, 12, 13], [11, 12], RequestStatus.FINISHED_LENGTH),
        ({"stop_token_ids": [12]}, [11, 12, 13], [11, 12], RequestStatus.FINISHED_STOPPED),
        ({"min_tokens": 4}, [11, EOS, 13], [11, EOS, 13, 60], None),
    ],
)
def test_stop_inside_accepted_drafts_truncates(params, accept, kept, status) -> None:
    sched, req = make(), request("a", **params)
    bm = sched.block_manager
    prefill(sched, req)
    req.spec_token_ids = list(accept)
    out, finished, got = verify(sched, {"a": 3})
    assert got == {"a": kept} and req.output_token_ids == [50, *kept]
    if status is None:
        assert not finished and req.num_computed_tokens == 6 + len(kept)
    else:
        assert finished == [req] and req.status is status
        assert req.block_ids == [] and bm.num_free_blocks == bm.num_blocks


def test_drafts_ignored_unless_one_token_is_pending() -> None:
    sched, req = make(max_num_batched_tokens=4), request("a", 10)
    req.spec_token_ids = [11, 12]  # still a prompt to compute: no drafts
    sched.add_request(req)
    out: SchedulerOutput = sched.schedule()
    assert [(s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(4, [])]
    assert req.spec_token_ids == []
