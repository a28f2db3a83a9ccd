"""What a chat request's tools and thinking become for the engine (gateway/chat_output.py):
markers that are special tokens of the tokenizer are matched by id and kept in the
decoded text; a special end-of-thinking tag still opens the answer's constraint; bad
tool choices and template keywords are 400s naming the field."""

from __future__ import annotations

import llguidance
import pytest
from transformers import AutoTokenizer

from gateway.chat_output import ChatOptions, ChatOutputs
from gateway.request_errors import InvalidRequest
from services.chat import render_chat
from services.structured.outputs import StructuredOutputs
from services.structured.tokenizer import guidance_tokenizer
from tests.helpers.checkpoints import make_byte_bpe_checkpoint
from tests.helpers.tool_calls import FUNCTIONS

TOOLS = [
    {"type": "function", "function": {"name": f.name, "parameters": f.parameters}}
    for f in FUNCTIONS
]


@pytest.fixture(scope="module")
def special_tok(tiny_root):
    tok = AutoTokenizer.from_pretrained(str(make_byte_bpe_checkpoint(tiny_root)))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "</think>"]})
    return tok


def test_special_markers_are_matched_by_id_and_kept_in_the_text(special_tok):
    outputs = ChatOutputs(special_tok, "mistral", True, "deepseek_r1")
    params: dict = {}
    options = ChatOptions.of(TOOLS, "required", thinking_token_budget=8)
    parsers = outputs.plan(options, params, "prompt")
    assert params["skip_special_tokens"] is False and parsers.tools is not None
    marker = special_tok.convert_tokens_to_ids("[TOOL_CALLS]")
    end = special_tok.convert_tokens_to_ids("</think>")
    constraint = params["structured_outputs"]
    assert f"<[{marker}]>" in constraint.grammar and constraint.reasoning_end == f"<[{end}]>"
    assert params["reasoning_end_token_ids"] == [end]
    ll = guidance_tokenizer(special_tok, [special_tok.eos_token_id], len(special_tok))
    m = llguidance.LLMatcher(ll, constraint.lark(), log_level=0)
    think = special_tok.encode("a < b ", add_special_tokens=False)
    call = special_tok.encode('[{"name": "get_time", "arguments": {"zone": "UTC", "utc": true}}]')
    assert m.consume_tokens([*think, end, marker, *call]) and m.is_accepting(), m.get_error()


def test_a_text_tag_stays_text(tiny_root):
    tok = AutoTokenizer.from_pretrained(str(make_byte_bpe_checkpoint(tiny_root)))
    params = {"structured_outputs": StructuredOutputs(regex="[0-9]+")}
    ChatOutputs(tok, "", False, "qwen3").plan(ChatOptions(), params, "p")
    assert params["structured_outputs"].reasoning_end == "</think>"
    assert "skip_special_tokens" not in params


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": None},
            "tools",
        ),
    ],
)
def test_bad_tool_choices(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        ChatOptions.of(kwargs["tools"], kwargs["tool_choice"])
    assert e.value.param == param


def test_reserved_template_keywords_and_refusing_templates(tiny_root):
    with pytest.raises(InvalidRequest, match="chat_template"):
        ChatOptions.of(None, None, template_kwargs={"chat_template": "{{ 1 }}"})
    tok = AutoTokenizer.from_pretrained(str(make_byte_bpe_checkpoint(tiny_root)))
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="^messages: the chat template refused them"):
        render_chat(tok, [{"role": "user", "content": "hi"}])
