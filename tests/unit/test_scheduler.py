"""Scheduler: token budget, chunked prefill, preemption, aborts and stop rules.

A fake "model" (plain Python) returns a fixed next token for every request that
reached its last known token, so full request lifecycles run in microseconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.scheduler_config import SchedulerConfig
from services.engine.scheduler_output import SchedulerOutput
from services.engine.stopping import check_stop
from services.sampling_params import SamplingParams

EOS = 2
TOKEN = 7  # what the fake model always samples


def make_request(rid: str, prompt: list[int] | int, **params: object) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 4)
    return Request(rid, tokens, SamplingParams(**params), eos_token_ids=(EOS,))


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64, **config: object
) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=max_model_len, **config)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def step(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: the fake model samples ``token`` wherever a token is due."""
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    return out, sched.update_from_output(out, sampled)


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.num_new_tokens, s.start, s.sample) for s in out.scheduled]


def run_all(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(step(sched)[0])
    return outputs


def test_engine_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import services.engine.block_manager, services.engine.scheduler\n"
        "import services.engine.scheduler_output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_config_validation() -> None:
    assert SchedulerConfig(max_model_len=16).max_num_batched_tokens == 8192
    for bad in ({"max_model_len": 0}, {"max_model_len": 8, "max_num_seqs": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            SchedulerConfig(**bad)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_model_len=8, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_add_request_validation_and_queue_accessors() -> None:
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 3))
    assert sched.get_request("a") is not None and sched.num_waiting == 1
    assert sched.get_request("a").max_model_len == 16  # clamped to the engine's
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        sched.add_request(make_request("long", 17))
    small = make_scheduler(num_blocks=3, block_size=4, max_model_len=16)
    small.add_request(make_request("fits", 8, max_tokens=4))  # 12 tokens, 3 blocks
    with pytest.raises(ValueError, match="may need 4 KV blocks"):
        small.add_request(make_request("big", 8, max_tokens=5))
    assert small.get_request("big") is None
    step(sched)
    assert (sched.num_running, sched.num_waiting, sched.has_unfinished()) == (1, 0, True)


def test_budget_split_between_decode_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_request("a", 3, max_tokens=5)
    sched.add_request(a)
    out, _ = step(sched)
    assert shape(out) == [("a", 3, 0, True)] and out.total_num_tokens == 3
    b = make_request("b", 20)
    sched.add_request(b)
    assert shape(step(sched)[0]) == [("a", 1, 3, True), ("b", 9, 0, False)]
    assert b.output_token_ids == []  # a partial prefill produces no token
    assert shape(step(sched)[0]) == [("a", 1, 4, True), ("b", 9, 9, False)]
    assert shape(step(sched)[0]) == [("a", 1, 5, True), ("b", 2, 18, True)]
    assert b.output_token_ids == [TOKEN] and b.num_computed_tokens == 20
    out, finished = step(sched)
    assert shape(out) == [("a", 1, 6, True), ("b", 1, 20, True)]
    assert finished == [a] and a.status is RequestStatus.FINISHED_LENGTH
    out, _ = step(sched)
    assert shape(out) == [("b", 1, 21, True)] and out.finished_ids == ["a"]


def test_running_request_without_budget_is_skipped_not_preempted() -> None:
    sched = make_scheduler()
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 1))
    step(sched)
    sched.config.max_num_batched_tokens = 1
    out, _ = step(sched)
    assert shape(out) == [("a", 1, 1, True)] and out.preempted_ids == []
    assert sched.num_running == 2


def test_chunked_prefill_disabled_admits_whole_prompts_only() -> None:
    sched = make_scheduler(
        max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("b", list(range(300, 316)), max_tokens=1))
    assert shape(step(sched)[0]) == [("a", 4, 0, True)]  # b needs 16, 12 left
    assert shape(step(sched)[0]) == [("a", 1, 4, True)]
    assert shape(step(sched)[0]) == [("a", 1, 5, True)]  # a finishes here
    assert shape(step(sched)[0]) == [("b", 16, 0, True)]


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 2, max_tokens=2))
    assert [s.request_id for s in step(sched)[0].scheduled] == ["a", "b"]
    assert sched.num_waiting == 1
    out, finished = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and len(finished) == 2
    assert shape(step(sched)[0]) == [("c", 2, 0, True)]


def test_fifo_head_blocks_later_requests() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(make_request("x", 9))  # 3 blocks
    sched.add_request(make_request("a", 8))  # 2 blocks: only 1 left
    sched.add_request(make_request("b", 2))  # would fit, but must not overtake "a"
    assert [s.request_id for s in step(sched)[0].scheduled] == ["x"]
    assert [r.request_id for r in sched.waiting] == ["a", "b"]


def test_preemption_by_recompute_with_tiny_pool() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    bm = sched.block_manager
    a, b = make_request("a", [1, 3, 5]), make_request("b", [4, 5, 6])
    sched.add_request(a)
    sched.add_request(b)
    assert shape(step(sched)[0]) == [("a", 3, 0, True), ("b", 3, 0, True)]
    assert (a.block_ids, b.block_ids, bm.num_free_blocks) == ([0, 1], [2, 3], 0)
    step(sched)  # token 3 still fits each request's second block
    out, _ = step(sched)  # a needs a third block: the last running request goes
    assert shape(out) == [("a", 1, 4, True)] and out.preempted_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert (b.num_computed_tokens, b.block_ids) == (0, [])
    assert list(sched.waiting) == [b] and a.block_ids == [0, 1, 3]
    # b's first block (2) is still cached, but claiming it leaves nothing for the rest.
    out, finished = step(sched)
    assert shape(out) == [("a", 1, 5, True)] and finished == [a]
    out, _ = step(sched)
    assert out.finished_ids == ["a"]
    # Recompute prompt + 2 outputs; the cached first block (2 tokens) is reused.
    assert shape(out) == [("b", 3, 2, True)] and b.num_cached_tokens == 2
    assert b.block_ids == [2, 3, 1]
    run_all(sched)
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [TOKEN] * 4
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert [bm.ref_count(i) for i in range(4)] == [0, 0, 0, 0]


def test_preemption_keeps_arrival_order_and_can_hit_the_request_itself() -> None:
    sched = make_scheduler(num_blocks=5, block_size=2, max_model_len=8)
    reqs = [make_request("a", 3), make_request("b", 3), make_request("c", 1)]
    for req in reqs:
        sched.add_request(req)
    step(sched)
    step(sched)
    out, _ = step(sched)  # a and b both need a new block; c's one block serves a
    assert shape(out) == [("a", 1, 4, True)]
    assert out.preempted_ids == ["c", "b"]  # b found no block and preempted itself
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    run_all(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.output_token_ids == [TOKEN] * 4 for r in reqs)
    assert sched.block_manager.num_free_blocks == 5


def test_abort_from_waiting_reports_once() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    aborted = sched.abort_request("a")
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert sched.get_request("a") is None and sched.num_waiting == 1
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    out = sched.schedule()
    assert out.finished_ids == ["a"] and [s.request_id for s in out.scheduled] == ["b"]
    assert sched.schedule().finished_ids == []


def test_abort_from_running_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=8, max_model_len=32)
    sched.add_request(make_request("a", 10))
    step(sched)
    assert sched.block_manager.num_free_blocks == 5
    assert sched.abort_request("a") is not None
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.schedule().finished_ids == ["a"]
    assert sched.schedule().finished_ids == []


def test_abort_while_step_runs_drops_its_result() -> None:
    sched = make_scheduler()
    a = make_request("a", 5)
    sched.add_request(a)
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update_from_output(out, {"a": TOKEN}) == []
    assert (a.num_computed_tokens, a.output_token_ids) == (0, [])


def test_finish_request_externally() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    step(sched)
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)
    req = sched.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert req is not None and (req.status, req.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        "###",
    )
    assert req.block_ids == [] and sched.block_manager.num_free_blocks == 64
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is None
    assert sched.schedule().finished_ids == ["a"]


def test_prefix_cache_hit_on_second_request() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=1))
    run_all(sched)
    b = make_request("b", 10, max_tokens=1)
    sched.add_request(b)
    out, _ = step(sched)
    assert shape(out) == [("b", 2, 8, True)] and b.num_cached_tokens == 8


def test_imported_kv_skips_prefill() -> None:
    sched = make_scheduler()
    bm = sched.block_manager
    req = make_request("imp", 6, max_tokens=3)
    req.append_output_token(TOKEN)  # sampled by the prefill instance
    assert bm.allocate_for_import(req, 6) == [0, 1]
    req.num_computed_tokens = 6  # the KV has landed
    sched.add_request(req)
    assert shape(step(sched)[0]) == [("imp", 1, 6, True)]
    assert req.block_ids == [0, 1] and bm.prefix_query_tokens == 0
    stale = make_request("stale", 4)
    stale.num_computed_tokens = 4  # imported KV but no first token: nothing to do
    with pytest.raises(ValueError, match="no token left"):
        sched.add_request(stale)
    run_all(sched)
    assert req.output_token_ids == [TOKEN] * 3 and bm.num_free_blocks == 64


@pytest.mark.parametrize(
    ("params", "outputs", "expected"),
    [
        ({}, [5], None),
        ({}, [5, EOS], RequestStatus.FINISHED_STOPPED),
        ({"ignore_eos": True}, [EOS], None),
        ({"stop_token_ids": [9]}, [9], RequestStatus.FINISHED_STOPPED),
        ({"min_tokens": 2}, [EOS], None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9], None),
        ({"min_tokens": 2}, [5, EOS], RequestStatus.FINISHED_STOPPED),
        ({"max_tokens": 2}, [5, 5], RequestStatus.FINISHED_LENGTH),
        ({"max_tokens": 2}, [5, EOS], RequestStatus.FINISHED_STOPPED),  # EOS wins
        ({"max_tokens": None}, [5] * 6, RequestStatus.FINISHED_LENGTH),  # context full
        ({"max_tokens": 8, "min_tokens": 8}, [5] * 6, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_check_stop(params: dict, outputs: list[int], expected: RequestStatus | None) -> None:
    params.setdefault("max_tokens", 16)
    req = Request("r", [1, 1, 1, 1], SamplingParams(**params), eos_token_ids=(EOS,))
    req.max_model_len = 10
    req.output_token_ids = list(outputs)
    assert check_stop(req) is expected


def test_stop_reasons_through_the_scheduler() -> None:
    sched = make_scheduler()
    eos = make_request("eos", 3, min_tokens=2, max_tokens=8)
    sid = make_request("sid", 3, stop_token_ids=[EOS], ignore_eos=True, max_tokens=8)
    for req in (eos, sid):
        sched.add_request(req)
    outputs = []
    while sched.has_unfinished():
        outputs.append(step(sched, token=EOS))
    assert len(outputs) == 2  # min_tokens holds both EOS-stopped requests for 2 tokens
    assert sid.output_token_ids == [EOS] and sid.stop_reason == EOS
    assert eos.output_token_ids == [EOS, EOS] and eos.stop_reason is None
    assert eos.status is sid.status is RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_ids == ["eos"]


def test_max_model_len_ends_requests() -> None:
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", 6, max_tokens=None)
    sched.add_request(req)
    run_all(sched)
    assert req.num_output_tokens == 2 and req.status is RequestStatus.FINISHED_LENGTH


# ----------------------------------------------------------------- bursts (multi-step)


def burst(sched: Scheduler, steps: int, tokens: list[int] | None = None):
    """One scheduling round asking for ``steps`` decode steps; the fake model samples
    ``tokens`` (TOKEN each step by default) for every request of a burst."""
    out = sched.schedule(steps)
    if out.num_steps == 1:
        sampled = {s.request_id: TOKEN for s in out.scheduled if s.sample}
        return out, sched.update_from_output(out, sampled), None
    sampled = {s.request_id: list(tokens or [TOKEN] * out.num_steps) for s in out.scheduled}
    finished, kept = sched.update_from_tokens(out, sampled)
    return out, finished, kept


def test_a_burst_covers_every_step_with_blocks() -> None:
    sched = make_scheduler(block_size=4)
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    out, _, _ = burst(sched, 4)  # prefill: never a burst
    assert out.num_steps == 1 and req.num_tokens == 6
    out, finished, kept = burst(sched, 4)
    assert out.num_steps == 4 and shape(out) == [("a", 1, 5, True)]
    assert len(req.block_ids) == 3  # positions 5..8 written: 9 tokens, 3 blocks of 4
    assert kept == {"a": [TOKEN] * 4} and not finished
    assert req.num_computed_tokens == 9 and req.num_tokens == 10


def test_a_burst_stops_at_max_tokens() -> None:
    sched = make_scheduler(block_size=4)
    req = make_request("a", 5, max_tokens=3)
    sched.add_request(req)
    burst(sched, 8)
    out, finished, kept = burst(sched, 8)
    assert out.num_steps == 2  # 1 token from the prefill, 2 left
    assert finished == [req] and req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [TOKEN] * 3 and kept == {"a": [TOKEN] * 2}


def test_a_stop_token_mid_burst_drops_the_rest_and_frees_the_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    burst(sched, 4)
    out, finished, kept = burst(sched, 4, [11, EOS, 12, 13])
    assert out.num_steps == 4 and finished == [req]
    assert kept == {"a": [11, EOS]} and req.output_token_ids == [TOKEN, 11, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.num_computed_tokens == 7
    assert sched.block_manager.num_free_blocks == 16


def test_no_burst_while_a_request_waits_or_prefills() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    a = make_request("a", 6, max_tokens=8)
    sched.add_request(a)
    burst(sched, 4)
    sched.add_request(make_request("b", list(range(200, 212)), max_tokens=3))
    out, _, _ = burst(sched, 4)  # b waits: the round admits it instead of bursting
    assert out.num_steps == 1 and [s.request_id for s in out.scheduled] == ["a", "b"]
    out, _, _ = burst(sched, 4)  # b's prompt is not all done (chunked): no burst
    assert out.num_steps == 1 and shape(out)[1] == ("b", 5, 7, True)
    out, _, _ = burst(sched, 4)  # both decode now
    assert out.num_steps == 2  # b has 2 tokens left of its 3


def test_no_burst_when_the_pool_lacks_its_blocks() -> None:
    for num_blocks, steps in ((6, 4), (5, 1)):
        sched = make_scheduler(num_blocks=num_blocks, block_size=4)
        for rid in "ab":
            sched.add_request(make_request(rid, 6, max_tokens=6))
        burst(sched, 1)  # both prefills: 2 blocks each
        out, _, _ = burst(sched, 4)  # a burst of 4 needs a third block each
        assert out.num_steps == steps and len(out.scheduled) == 2
        assert sched.num_preemptions == 0


def test_whole_images_end_chunks_before_an_image_never_inside() -> None:
    """Gemma 3's rule: a chunk that would end inside an image ends before it; the image
    then goes whole in a later step, and a request that starts inside one (a prefix-cache
    hit) runs to its end."""
    from services.engine.request import ImageSpan

    sched = make_scheduler(max_num_batched_tokens=8, whole_images=True)
    req = make_request("a", 20, max_tokens=1)
    req.images = [ImageSpan(5, 6, "img")]  # tokens 5..10
    sched.add_request(req)
    chunks = [shape(step(sched)[0]) for _ in range(3)]
    assert [c[0][1:3] for c in chunks] == [(5, 0), (8, 5), (7, 13)]
    assert sched._chunk(req, 3, start=7) == 5 - 7  # would end at 10, inside: waits
    assert sched._chunk(req, 8, start=7) == 8  # ends at 15, past the image
