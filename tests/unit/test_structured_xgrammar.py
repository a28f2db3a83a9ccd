"""xgrammar, the second grammar backend: JSON schemas, regexes, choices and GBNF are
compiled by it, Lark (the gateway's tool and reasoning grammars) still by llguidance,
and one batch mixes both; WordPiece and byte-level BPE tokenizers; speculative decoding
changes no token under it either."""

from __future__ import annotations

import json
import re

import pytest

from services import LLM, SamplingParams
from services.structured.outputs import StructuredOutputs
from services.structured.xgrammar_backend import XGrammarMatcher
from tests.helpers.checkpoints import make_byte_bpe_checkpoint, make_sentencepiece_checkpoint
from tests.helpers.schemas import RECORD

SCHEMA = RECORD
LARK = '%llguidance {}\nstart: "<" WORD ">"\nWORD: /[a-z]{2,5}/'


def fits(text: str) -> bool:
    # strict=False: xgrammar 0.2.9 lets raw control characters into JSON strings
    # (docs/structured-outputs.md); the schema is what is checked here.
    doc = json.loads(text, strict=False)
    return set(doc) == {"name", "n", "color"} and len(doc["name"]) <= 10 and doc["n"] <= 999


@pytest.fixture(scope="module", params=["wordpiece", "byte-bpe", "sentencepiece"])
def llm(request, llama_ckpt, tiny_root):
    ckpt = {
        "wordpiece": lambda: llama_ckpt,
        "byte-bpe": lambda: make_byte_bpe_checkpoint(tiny_root),
        "sentencepiece": lambda: make_sentencepiece_checkpoint(tiny_root),
    }[request.param]()
    return LLM(str(ckpt), block_size=4, num_kv_blocks=256, structured_outputs_backend="xgrammar")


def test_each_kind_and_a_mixed_batch(llm):
    asks = [
        {"json": SCHEMA},
        {"regex": r"[a-c]{3}-[0-9]{2}"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "on" | "off"'},
        {"grammar": LARK},  # llguidance's, in the same batch
        None,
    ] * 2
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=a)
        for i, a in enumerate(asks)
    ]
    outs = llm.generate([f"q{i}" for i in range(len(asks))], params)
    for ask, out in zip(asks, outs, strict=True):
        text = out.outputs[0].text.strip()
        if ask is None:
            continue
        kind, value = next(iter(ask.items()))
        if kind == "json":
            assert fits(text), text
        elif kind == "regex":
            assert re.fullmatch(value, text), text
        elif kind == "choice":
            assert text in value
        elif value == LARK:
            assert re.fullmatch(r"<[a-z]{2,5}>", text.replace(" ", "")), text
        else:
            assert text in ("on", "off")
    grammars = llm.engine.grammars
    assert isinstance(grammars.matcher(StructuredOutputs(json=SCHEMA), []), XGrammarMatcher)
    assert not isinstance(grammars.matcher(StructuredOutputs(grammar=LARK), []), XGrammarMatcher)


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "([a-"}))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "root ::= ("}))


def test_speculation_changes_no_token(tiny_root):
    ckpt = str(make_byte_bpe_checkpoint(tiny_root))
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    plain = LLM(ckpt, block_size=4, num_kv_blocks=256, structured_outputs_backend="xgrammar")
    spec = LLM(
        ckpt,
        block_size=4,
        num_kv_blocks=256,
        structured_outputs_backend="xgrammar",
        speculative_config=cfg,
    )
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 4}):
        params = SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMA}, **kw)
        a = [o.outputs[0].token_ids for o in plain.generate(["a", "bb", "ccc"], params)]
        b = [o.outputs[0].token_ids for o in spec.generate(["a", "bb", "ccc"], params)]
        assert a == b
    assert spec.engine.spec.stats.accepted_tokens > 0  # forced tokens at least
