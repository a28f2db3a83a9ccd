"""A reasoning model's thinking in the engine: the budget forces the end of thinking
after ``thinking_token_budget`` tokens, and a constraint with ``reasoning_end`` applies
only after that end; both survive the bus (wire) and a resumed request."""

from __future__ import annotations

import json
import re

import pytest

from services import LLM, SamplingParams
from services.engine.thinking import ThinkingBudget
from services.structured.outputs import StructuredOutputs
from services.wire import params_from_proto, params_to_proto
from tests.helpers.checkpoints import make_byte_bpe_checkpoint

END = "</think>"


@pytest.fixture(scope="module")
def llm(tiny_root):
    return LLM(str(make_byte_bpe_checkpoint(tiny_root)), block_size=4, num_kv_blocks=256)


@pytest.mark.parametrize(
    "engine",
    [
        {"num_scheduler_steps": 4},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
)
def test_the_budget_holds_with_bursts_and_speculation(tiny_root, llm, engine):
    """Greedy bursts and drafts never step over the position where the end is forced;
    under speculation a constraint after the thinking still applies."""
    other = LLM(str(make_byte_bpe_checkpoint(tiny_root)), block_size=4, num_kv_blocks=256, **engine)
    end = _end_ids(llm)
    out = _generate(
        other, max_tokens=12, ignore_eos=True, thinking_token_budget=3, reasoning_end_token_ids=end
    )
    assert out.token_ids[3 : 3 + len(end)] == end
    constraint = StructuredOutputs(regex="[0-9]{2}", reasoning_end=END)
    out = _generate(
        other,
        max_tokens=40,
        structured_outputs=constraint,
        thinking_token_budget=3,
        reasoning_end_token_ids=end,
    )
    assert out.token_ids[3 : 3 + len(end)] == end
    assert re.fullmatch(r"\n{0,2}[0-9]{2}", out.text.split(END, 1)[1]), out.text


def _end_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(END, add_special_tokens=False)


def _generate(llm: LLM, **kw):
    (out,) = llm.generate(["think about it"], SamplingParams(temperature=0.0, **kw))
    return out.outputs[0]


def test_budget_forces_the_end_after_that_many_tokens(llm):
    end = _end_ids(llm)
    for budget in (0, 3, 7):
        out = _generate(
            llm,
            max_tokens=budget + len(end) + 4,
            ignore_eos=True,
            thinking_token_budget=budget,
            reasoning_end_token_ids=end,
        )
        free = _generate(llm, max_tokens=budget + len(end) + 4, ignore_eos=True)
        assert out.token_ids[:budget] == free.token_ids[:budget]  # free until the budget
        assert out.token_ids[budget : budget + len(end)] == end


def test_budget_state_is_a_function_of_the_tokens():
    b = ThinkingBudget(4, [8, 9])
    assert b.forced([1, 2]) is None
    assert b.forced([1, 2, 3, 4]) == 8
    assert b.forced([1, 2, 3, 4, 8]) == 9
    assert b.forced([1, 2, 3, 4, 8, 9]) is None and b.done
    early = ThinkingBudget(4, [8, 9])
    assert early.forced([1, 8, 9, 5, 6]) is None and early.done  # the model ended it
    late = ThinkingBudget(4, [8, 9])  # a step ran past the budget: the end still comes
    assert late.forced([1, 2, 3, 4, 5, 6]) == 8 and late.forced([1, 2, 3, 4, 5, 8]) == 9


def test_constraint_applies_after_the_thinking(llm):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    constraint = StructuredOutputs(json=schema, reasoning_end=END)
    out = _generate(
        llm,
        max_tokens=60,
        structured_outputs=constraint,
        thinking_token_budget=5,
        reasoning_end_token_ids=_end_ids(llm),
    )
    thinking, answer = out.text.split(END, 1)
    assert len(llm.tokenizer.encode(thinking, add_special_tokens=False)) <= 6
    assert isinstance(json.loads(answer)["a"], int)


def test_thinking_fields_cross_the_wire():
    sp = SamplingParams(
        thinking_token_budget=12,
        reasoning_end_token_ids=[5, 6],
        structured_outputs=StructuredOutputs(regex="[0-9]+", reasoning_end=END),
    )
    back = params_from_proto(params_to_proto(sp))
    assert back.thinking_token_budget == 12 and back.reasoning_end_token_ids == [5, 6]
    assert back.structured_outputs == sp.structured_outputs
    assert params_from_proto(params_to_proto(SamplingParams())).thinking_token_budget is None


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        SamplingParams(thinking_token_budget=3)
    with pytest.raises(ValueError, match=">= 0"):
        SamplingParams(thinking_token_budget=-1, reasoning_end_token_ids=[1])
