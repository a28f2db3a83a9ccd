"""n > 1 in the engine: every choice is what a lone request with its seed would draw, the
choices share the prompt's KV blocks, and aborts (of the whole request or one choice)
free everything."""

from __future__ import annotations

import pytest

from services import LLM, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.parallel_sampling import child_request_id
from services.sampling_params import choice_seed

PROMPT = {"prompt_token_ids": [1000 + 13 * i for i in range(38)]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.helpers.checkpoints import make_text_checkpoint

    ckpt = make_text_checkpoint(tmp_path_factory.mktemp("par"), "llama")
    return LLM(str(ckpt), block_size=4, num_kv_blocks=128)


def test_each_choice_is_the_lone_request_with_its_seed(llm):
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for choice in out.outputs:
        lone = SamplingParams(temperature=0.9, seed=choice_seed(5, choice.index), max_tokens=12)
        assert choice.token_ids == llm.generate(PROMPT, lone)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_greedy_choices_agree(llm):
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_choices_share_the_prompt_blocks(llm):
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    free0, hits0 = eng.block_manager.num_free_blocks, eng.block_manager.prefix_hit_tokens
    eng.add_request("share", PROMPT, SamplingParams(n=4, temperature=0.5, seed=1, max_tokens=8))
    shared = 0
    while eng.has_unfinished_requests():
        eng.step()
        kids = [eng.scheduler.get_request(child_request_id("share", i)) for i in range(4)]
        if all(k is not None and k.block_ids for k in kids):
            first = kids[0].block_ids[0]
            shared = max(shared, eng.block_manager.ref_count(first))
            assert all(k.block_ids[:9] == kids[0].block_ids[:9] for k in kids)
    # 38 tokens: 9 full blocks of 4 are computed once and hit by the 3 siblings.
    assert shared == 4
    assert eng.block_manager.prefix_hit_tokens - hits0 == 3 * 36
    assert eng.block_manager.num_free_blocks == free0 and not eng.parallel.parents


def test_abort_of_the_request_frees_every_choice(llm):
    eng = llm.engine
    free0 = eng.block_manager.num_free_blocks
    eng.add_request("ab", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50))
    for _ in range(3):
        eng.step()
    out = eng.abort_request("ab")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not eng.has_unfinished_requests() and not eng.states
    assert eng.block_manager.num_free_blocks == free0


async def test_stream_merges_choices_and_survives_aborting_one(llm):
    eng = AsyncEngine(llm.engine)
    eng.start()
    try:
        params = SamplingParams(n=3, temperature=0.8, seed=9, max_tokens=10)
        texts: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finish: dict[int, str] = {}
        aborted = False
        async for out in eng.generate("st", PROMPT, params):
            for comp in out.outputs:
                texts[comp.index] += comp.token_ids_delta
                if comp.finish_reason:
                    finish[comp.index] = comp.finish_reason
            if not aborted and len(texts[1]) >= 2:
                aborted = True
                await eng.abort(child_request_id("st", 1))
        assert out.finished and finish[1] == "abort" and finish[0] == finish[2] == "length"
    finally:
        await eng.shutdown()
    # Only now: while the AsyncEngine runs, its thread steps the same engine.
    full = llm.generate(PROMPT, params)
    assert texts[0] == full[0].outputs[0].token_ids
    assert texts[2] == full[0].outputs[2].token_ids


def test_bad_n_is_refused(llm):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="prefill role"):
        llm.engine.add_request("x", PROMPT, SamplingParams(n=2), export_kv=True)
    assert not llm.engine.has_unfinished_requests()
