"""Multi-step scheduling (``num_scheduler_steps``): greedy decode batches run several steps
per scheduling round, natively on the cpu backend and as a loop on the torch backend,
and every output is the one single steps give: tokens, stop tokens and strings mid-burst,
max_tokens, streaming deltas; batches that need more per token never burst."""

from __future__ import annotations

import pytest
import torch

from services import LLM, SamplingParams


@pytest.fixture(scope="module")
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=["cpu", "torch"])
def llm(request, llama_ckpt, one_thread):
    llm = LLM(
        str(llama_ckpt),
        block_size=4,
        num_kv_blocks=256,
        attention_backend=request.param,
        enable_prefix_caching=False,
    )
    assert llm.engine.backend.name == request.param
    return llm


class _Count:
    """Counts the engine's bursts and native burst calls while active."""

    def __init__(self, llm: LLM):
        self.runner, self.model = llm.engine.runner, llm.engine.model
        self.bursts = self.native = 0

    def __enter__(self):
        burst, native = self.runner.execute_burst, self.model.decode_greedy

        def count_burst(*a):
            self.bursts += 1
            return burst(*a)

        def count_native(*a):
            out = native(*a)
            self.native += out is not None
            return out

        self.runner.execute_burst, self.model.decode_greedy = count_burst, count_native
        return self

    def __exit__(self, *exc):
        del self.runner.execute_burst, self.model.decode_greedy


def _generate(llm: LLM, prompts, params, steps: int):
    llm.engine.config.num_scheduler_steps = steps
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.engine.config.num_scheduler_steps = 1


PROMPTS = [[1000 + 7 * i for i in range(n)] for n in (5, 17, 11)]


@pytest.mark.parametrize("n", [1, 3])
def test_bursts_give_the_tokens_of_single_steps(llm, n):
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    want = _generate(llm, PROMPTS[:n], params, 1)
    with _Count(llm) as c:
        got = _generate(llm, PROMPTS[:n], params, 4)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert c.bursts == 3  # 1 token from the prefill, then bursts of 4, 4 and 2
    assert c.native == (3 if llm.engine.backend.name == "cpu" else 0)


def test_stops_mid_burst(llm):
    base = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ids = _generate(llm, PROMPTS[:1], base, 1)[0].outputs[0].token_ids
    for kw in (
        {"stop_token_ids": [ids[6]]},
        {"stop": [_generate(llm, PROMPTS[:1], base, 1)[0].outputs[0].text[12:15]]},
    ):
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **kw)
        want = _generate(llm, PROMPTS[:1], params, 1)[0].outputs[0]
        got = _generate(llm, PROMPTS[:1], params, 4)[0].outputs[0]
        assert want.finish_reason == "stop" and len(want.token_ids) < 14
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
    assert llm.engine.block_manager.num_free_blocks == llm.engine.kv.num_blocks


def test_batches_that_need_more_per_token_do_not_burst(llm):
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for params in (
        [greedy, sampled],
        SamplingParams(temperature=0, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=6, repetition_penalty=1.3),
    ):
        want = _generate(llm, PROMPTS[:2], params, 1)
        with _Count(llm) as c:
            got = _generate(llm, PROMPTS[:2], params, 4)
        assert c.bursts == 0
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_streaming_outputs_come_a_burst_at_a_time(llm):
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = _generate(llm, PROMPTS[:1], params, 1)[0].outputs[0]
    eng.config.num_scheduler_steps = 4
    try:
        eng.add_request("s", {"prompt_token_ids": PROMPTS[0]}, params)
        deltas = []
        while eng.has_unfinished_requests():
            for out in eng.step():
                deltas.append(out.outputs[0])
    finally:
        eng.config.num_scheduler_steps = 1
    assert [len(d.token_ids_delta) for d in deltas] == [1, 4, 4]
    assert [t for d in deltas for t in d.token_ids_delta] == want.token_ids
    assert "".join(d.text_delta for d in deltas) == want.text
