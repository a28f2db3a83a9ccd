"""The asyncio engine: concurrent streams, abort, bad input, and the prefill/decode
hand-off (KV export + import) giving exactly the aggregated tokens."""

from __future__ import annotations

import asyncio
import time

import pytest

from services import SamplingParams
from services.config import EngineConfig
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from tests.helpers.checkpoints import make_text_checkpoint

PROMPTS = [[1000 + i * 7 + j for j in range(n)] for i, n in enumerate((5, 18, 33, 9))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


def _engine(ckpt, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128, **kw))


async def _collect(agen):
    last = None
    async for out in agen:
        last = out
    return last


def _reference(ckpt, params):
    eng = _engine(ckpt)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


async def test_concurrent_streams_match_sync_engine(ckpt):
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=10)
    ref = _reference(ckpt, params)
    eng = AsyncEngine(_engine(ckpt))
    eng.start()
    try:
        outs = await asyncio.gather(
            *[
                _collect(eng.generate(f"a{i}", {"prompt_token_ids": p}, params))
                for i, p in enumerate(PROMPTS)
            ]
        )
        assert [o.outputs[0].token_ids for o in outs] == ref
        with pytest.raises(ValueError, match="empty"):
            await _collect(eng.generate("bad", {"prompt_token_ids": []}, params))
    finally:
        await eng.shutdown()
        await eng.shutdown()  # twice is safe


async def test_abort_mid_stream_frees_blocks(ckpt):
    eng = AsyncEngine(_engine(ckpt))
    eng.start()
    free0 = eng.engine.block_manager.num_free_blocks
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        agen = eng.generate("x", {"prompt_token_ids": PROMPTS[2]}, params)
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()  # the client went away
        await eng.call(lambda: None)  # the abort command has run
        assert eng.engine.block_manager.num_free_blocks == free0
        assert not eng.engine.has_unfinished_requests()
    finally:
        await eng.shutdown()


async def test_a_stream_past_its_deadline_raises_and_frees_its_blocks(ckpt):
    eng = AsyncEngine(_engine(ckpt))
    eng.start()
    free0 = eng.engine.block_manager.num_free_blocks
    try:
        params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        prompt = {"prompt_token_ids": PROMPTS[1]}
        agen = eng.generate("late", prompt, params, deadline=time.time() + 0.5)
        first = await anext(agen)
        assert not first.finished
        # The engine thread stalls (a command runs between steps) past the deadline: the
        # request cannot finish before it, however fast the machine.
        stall = asyncio.ensure_future(eng.call(lambda: time.sleep(1.5)))
        with pytest.raises(TimeoutError, match="deadline"):
            async with asyncio.timeout(30):  # the test's own guard: never hang
                async for _ in agen:
                    pass
        await stall
        await eng.call(lambda: None)  # the abort command has run
        assert eng.engine.block_manager.num_free_blocks == free0
        assert not eng.engine.has_unfinished_requests()
        # A deadline already past: nothing is generated, and it says so at once.
        t0, got = time.monotonic(), 0
        with pytest.raises(TimeoutError):
            async for _ in eng.generate("gone", prompt, params, deadline=time.time() - 1):
                got += 1
        assert got == 0 and time.monotonic() - t0 < 10
        await eng.call(lambda: None)
        assert not eng.engine.has_unfinished_requests()
    finally:
        await eng.shutdown()


async def test_shutdown_mid_stream_fails_the_stream_instead_of_hanging(ckpt):
    from services.engine.async_engine import EngineDeadError

    eng = AsyncEngine(_engine(ckpt))
    eng.start()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    agen = eng.generate("long", {"prompt_token_ids": PROMPTS[1]}, params)
    await agen.__anext__()
    await eng.shutdown()
    with pytest.raises(EngineDeadError):
        async with asyncio.timeout(10):
            async for _ in agen:
                pass


def test_prefill_export_then_decode_import_matches_aggregated(ckpt):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    ref = _reference(ckpt, params)
    prefill, decode = _engine(ckpt), _engine(ckpt)
    handoff = {}
    for i, p in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", {"prompt_token_ids": p}, params, export_kv=True)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert out.finished and out.outputs[0].finish_reason is None
            handoff[out.request_id] = (out.outputs[0].token_ids[0], out.kv_blocks)
    assert prefill.block_manager.num_free_blocks == 128
    for i, p in enumerate(PROMPTS):
        first, kv = handoff[f"r{i}"]
        decode.import_request(f"r{i}", p, len(p), first, params, kv)
    done = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == ref
    assert decode.block_manager.num_free_blocks == 128


async def test_multi_step_streams_the_same_tokens(ckpt):
    """num_scheduler_steps: greedy streams arrive a burst at a time, same tokens."""
    params = SamplingParams(temperature=0, max_tokens=10)
    ref = _reference(ckpt, params)
    eng = AsyncEngine(_engine(ckpt, num_scheduler_steps=4))
    eng.start()

    async def stream(i, p):
        deltas = [
            o.outputs[0].token_ids_delta
            async for o in eng.generate(f"m{i}", {"prompt_token_ids": p}, params)
        ]
        return deltas

    try:
        streams = await asyncio.gather(*[stream(i, p) for i, p in enumerate(PROMPTS)])
    finally:
        await eng.shutdown()
    assert [[t for d in s for t in d] for s in streams] == ref
    assert any(len(d) > 1 for s in streams for d in s)  # some outputs carried a burst


async def test_a_caller_that_stops_waiting_does_not_kill_the_engine(ckpt):
    eng = AsyncEngine(_engine(ckpt))
    eng.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        for _ in range(20):  # cancel calls at every stage: queued, running, answered
            task = asyncio.create_task(eng.call(lambda: eng.engine.has_unfinished_requests()))
            await asyncio.sleep(0)
            task.cancel()
        async with asyncio.timeout(30):
            out = await _collect(eng.generate("after", {"prompt_token_ids": PROMPTS[0]}, params))
        assert eng.alive and len(out.outputs[0].token_ids) == 3
    finally:
        await eng.shutdown()
