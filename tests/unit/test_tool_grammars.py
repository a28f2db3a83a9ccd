"""Tool-call grammars, compiled by llguidance for a real byte-level BPE tokenizer
(markers as text, and as special tokens): each accepts its format's canonical text and
refuses arguments that break the schema, and random walks under its mask parse into
valid calls, so every valid output is the grammar's doing."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from gateway.tools import Function, tool_parser
from services.structured.tokenizer import guidance_tokenizer
from tests.helpers.checkpoints import make_byte_bpe_checkpoint
from tests.helpers.tool_calls import BAD, CET, MARKERS, PARIS, SCHEMAS, parser, write


class Guide:
    """A tokenizer as transformers and llguidance see it, and ``token`` for grammars."""

    def __init__(self, tokenizer, special: bool):
        self.tok, self.special = tokenizer, special
        self.ll = guidance_tokenizer(tokenizer, [tokenizer.eos_token_id], len(tokenizer))

    def token(self, marker: str) -> str:
        if self.special:
            return f"<[{self.tok.convert_tokens_to_ids(marker)}]>"
        return json.dumps(marker)

    def matcher(self, fmt: str, choice: str | None, parallel: bool) -> llguidance.LLMatcher:
        lark = parser(fmt.removesuffix("-named")).grammar(choice, parallel, self.token)
        matcher = llguidance.LLMatcher(self.ll, llguidance.grammar_from("lark", lark), log_level=0)
        assert not matcher.get_error(), matcher.get_error()
        return matcher

    def accepts(self, matcher: llguidance.LLMatcher, text: str) -> bool:
        ok = matcher.consume_tokens(self.tok.encode(text))
        return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="module", params=["text", "special"])
def guide(request, tiny_root):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(make_byte_bpe_checkpoint(tiny_root)))
    if request.param == "special":
        tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    return Guide(tokenizer, request.param == "special")


FORMATS = ["hermes", "llama3_json", "mistral", "mistral-named", "qwen3_coder"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_accepts_the_format_and_refuses_bad_arguments(guide, fmt):
    before = "" if fmt == "llama3_json" else "Sure. "
    cases = [
        ("required", False, write(fmt, [PARIS]), True),
        ("required", False, write(fmt, [PARIS, CET]), False),
        ("required", False, write(fmt, [BAD]), False),
        ("required", True, write(fmt, [PARIS, CET]), True),
        ("get_time", False, write(fmt, [CET]), True),
        ("get_time", False, write(fmt, [PARIS]), False),
        ("get_time", True, write(fmt, [CET, CET]), False),
        (None, False, before + write(fmt, [PARIS]), True),
        (None, False, "Just text, no call.", True),
        (None, False, before + write(fmt, [BAD]), False),
        (None, True, before + write(fmt, [PARIS, CET]), True),
    ]
    for choice, parallel, text, ok in cases:
        assert guide.accepts(guide.matcher(fmt, choice, parallel), text) == ok, (choice, text)


def walk(guide: Guide, matcher: llguidance.LLMatcher, rng: random.Random) -> str:
    """Random tokens among those the mask allows (end of text, when allowed, half the
    time) until the grammar ends; the text written."""
    mask, ids = allocate_token_bitmask(1, guide.ll.vocab_size), []
    eos = guide.tok.eos_token_id
    for _ in range(600):
        fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: guide.ll.vocab_size]
        allowed = [int(i) for i in np.flatnonzero(bits) if i != eos]
        if bits[eos] and (not allowed or rng.random() < 0.5):
            return guide.tok.decode(ids)
        ids.append(rng.choice(allowed))
        assert matcher.consume_token(ids[-1]), matcher.get_error()
    raise AssertionError(f"no end in 600 tokens: {guide.tok.decode(ids)!r}")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_random_walks_under_the_grammar_are_valid_calls(guide, fmt):
    for seed in range(4):
        for choice, parallel in [("required", False), ("required", True), ("get_time", False)]:
            text = walk(guide, guide.matcher(fmt, choice, parallel), random.Random(seed))
            content, calls = parser(fmt).parse(text)
            assert content == "" and calls and (parallel or len(calls) == 1), text
            assert choice == "required" or {c.name for c in calls} == {choice}
            for call in calls:
                assert jsonschema_rs.is_valid(SCHEMAS[call.name], json.loads(call.arguments)), text
        prefix = "<|python_tag|>" if fmt == "llama3_json" else "Sure. " + parser(fmt).markers[0]
        matcher = guide.matcher(fmt, None, seed % 2 == 1)
        assert matcher.consume_tokens(guide.tok.encode(prefix))
        text = prefix + walk(guide, matcher, random.Random(seed))
        content, calls = parser(fmt).parse(text)
        assert calls and content.startswith("" if fmt == "llama3_json" else "Sure."), text
        for call in calls:
            assert jsonschema_rs.is_valid(SCHEMAS[call.name], json.loads(call.arguments)), text


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_for_any_arguments(guide, fmt):
    """A function without a schema takes any object (qwen3_coder: any parameters)."""
    loose = [Function("note", {}), Function("ping", {"type": "object"})]
    args = {"text": "two\nlines", "tags": [1, {"x": None}]}
    lark = tool_parser(fmt.removesuffix("-named"))(loose).grammar("required", True, guide.token)
    matcher = llguidance.LLMatcher(guide.ll, llguidance.grammar_from("lark", lark), log_level=0)
    text = write(fmt, [("note", args), ("ping", {})])
    assert guide.accepts(matcher, text), text
    _, calls = tool_parser(fmt.removesuffix("-named"))(loose).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("note", args), ("ping", {})]
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        tool_parser(fmt.removesuffix("-named"))(loose).grammar("nope", False, guide.token)
