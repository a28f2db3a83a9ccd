"""Structured outputs in the engine: on tiny random-weight checkpoints every valid output
is the grammar's doing. JSON schema, json_object, regex, choice and grammars (Lark, GBNF)
on the WordPiece tokenizer (the demo's) and on byte-level BPE; greedy, seeded sampling,
n = 2, logprobs and a mixed batch; bad constraints refused naming the problem."""

from __future__ import annotations

import json
import re

import pytest

from services import LLM, SamplingParams
from services.structured.outputs import MAX_SCHEMA_DEPTH, StructuredOutputs
from tests.helpers.checkpoints import make_byte_bpe_checkpoint, make_sentencepiece_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    doc = json.loads(text)
    return (
        set(doc) == set(SCHEMA["properties"])
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 12
        and type(doc["age"]) is int
        and 0 <= doc["age"] <= 120
        and type(doc["ok"]) is bool
        and doc["color"] in ("red", "blue")
        and len(doc["tags"]) <= 3
        and all(type(t) is int for t in doc["tags"])
    )


@pytest.fixture(scope="module", params=["wordpiece", "byte-bpe", "sentencepiece"])
def llm(request, llama_ckpt, tiny_root):
    ckpt = {
        "wordpiece": lambda: llama_ckpt,
        "byte-bpe": lambda: make_byte_bpe_checkpoint(tiny_root),
        "sentencepiece": lambda: make_sentencepiece_checkpoint(tiny_root),
    }[request.param]()
    return LLM(str(ckpt), block_size=4, num_kv_blocks=256)


def _one(llm: LLM, prompt: str = "tell me", **kw):
    kw.setdefault("max_tokens", 120)
    (out,) = llm.generate([prompt], SamplingParams(**kw))
    return out.outputs


def test_json_schema_greedy_and_sampled(llm):
    (greedy,) = _one(llm, temperature=0.0, structured_outputs={"json": SCHEMA})
    assert greedy.finish_reason == "stop" and valid(greedy.text), greedy.text
    choices = _one(llm, temperature=1.0, seed=7, n=2, structured_outputs={"json": SCHEMA})
    assert len(choices) == 2 and all(valid(c.text) for c in choices)
    again = _one(llm, temperature=1.0, seed=7, n=2, structured_outputs={"json": SCHEMA})
    assert [c.text for c in again] == [c.text for c in choices]  # seeded: reproducible


def test_regex_choice_and_grammars(llm):
    (out,) = _one(llm, temperature=0.0, structured_outputs={"regex": r"[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", out.text.strip()), out.text
    for seed in range(4):
        (out,) = _one(llm, temperature=1.0, seed=seed, structured_outputs={"choice": ["yes", "no"]})
        assert out.text.strip() in ("yes", "no")
    lark = 'start: NUM "-" NUM\nNUM: /[0-9]{1,4}/'
    (out,) = _one(llm, temperature=0.0, structured_outputs={"grammar": lark})
    assert re.fullmatch(r"[0-9]{1,4}-[0-9]{1,4}", out.text.strip()), out.text
    gbnf = 'root ::= "on" | "off"'
    (out,) = _one(llm, temperature=1.0, seed=1, structured_outputs={"grammar": gbnf})
    assert out.text.strip() in ("on", "off")


def test_greedy_argmax_first_picks_what_the_full_logits_pick(llm):
    """A greedy constrained batch keeps the fast argmax where the grammar allows it and
    masks the full logits only where it does not: the same tokens as the full path
    (which logprobs force)."""
    asks = [{"json": SCHEMA}, {"regex": r"[a-c]{4}"}, {"choice": ["red", "blue"]}] * 2
    prompts = [f"q{i}" for i in range(len(asks))]
    fast = llm.generate(
        prompts,
        [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=a) for a in asks],
    )
    full = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0.0, max_tokens=80, logprobs=0, structured_outputs=a)
            for a in asks
        ],
    )
    for a, b in zip(fast, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_see_the_constrained_distribution(llm):
    (out,) = _one(llm, temperature=0.0, logprobs=3, structured_outputs={"choice": ["yes", "no"]})
    first = out.logprobs[0]  # token id -> Logprob: the top 3 and the token drawn

    def piece(token: int) -> str:
        return llm.engine.grammars.ll.decode_bytes([token]).decode().strip()

    finite = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert out.token_ids[0] in finite
    # Every token with probability left starts "yes" or "no": the rest were masked off.
    assert all(piece(t) and any(w.startswith(piece(t)) for w in ("yes", "no")) for t in finite)


def test_a_mixed_batch_keeps_each_requests_constraint(llm):
    asks = [
        {"json": SCHEMA},
        {"regex": r"[a-c]{4}"},
        {"choice": ["red", "blue", "green"]},
        None,
    ] * 4
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=120, structured_outputs=so)
        for i, so in enumerate(asks)
    ]
    outs = llm.generate([f"q{i}" for i in range(len(asks))], params)
    for so, out in zip(asks, outs, strict=True):
        text = out.outputs[0].text
        if so is None:
            continue
        if "json" in so:
            assert valid(text), text
        elif "regex" in so:
            assert re.fullmatch(r"[a-c]{4}", text.strip()), text
        else:
            assert text.strip() in so["choice"]


def test_a_constraint_that_cannot_finish_ends_at_length(llm):
    (out,) = _one(llm, temperature=0.0, max_tokens=3, structured_outputs={"json": SCHEMA})
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "nonsense"}}, "structured_outputs"),
        ({"regex": "([a-z"}, "structured_outputs"),
        ({"grammar": "start: ("}, "structured_outputs"),
    ],
)
def test_constraints_that_do_not_compile_are_refused_and_the_engine_serves_on(
    llm, constraint, message
):
    with pytest.raises(ValueError, match=message):
        _one(llm, structured_outputs=constraint)
    (out,) = _one(llm, temperature=0.0, max_tokens=4)
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "schema object"),
        ({"colour": "x"}, "unsupported key"),
        ({"grammar": "  "}, "non-empty string"),
    ],
)
def test_bad_structured_outputs_objects(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=value)


def test_schemas_are_bounded():
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper"):
        StructuredOutputs(json=deep)
    with pytest.raises(ValueError, match="larger than"):
        StructuredOutputs(json={"enum": ["x" * 100] * 1000})


def test_the_key_names_the_constraint():
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {}}})
    b = StructuredOutputs(json={"properties": {"a": {}}, "type": "object"})
    assert a.key() == b.key() != StructuredOutputs(json_object=True).key()


@pytest.mark.parametrize(
    "value",
    [
        {"json": SCHEMA},
        {"json": json.dumps(SCHEMA)},
        {"regex": "[a-c]+"},
        {"choice": ["a", "b c"]},
        {"grammar": 'root ::= "x"'},
        {"json_object": True},
    ],
)
def test_the_constraint_crosses_the_bus(value):
    from services.wire import params_from_proto, params_to_proto

    sent = SamplingParams(structured_outputs=value)
    got = params_from_proto(params_to_proto(sent)).structured_outputs
    assert got.lark() == sent.structured_outputs.lark()
    assert params_from_proto(params_to_proto(SamplingParams())).structured_outputs is None


def test_the_fleet_gateway_checks_syntax_without_a_model():
    assert StructuredOutputs(regex="[0-9]+").check()
    for bad in (StructuredOutputs(regex="([a-z"), StructuredOutputs(json={"type": "nonsense"})):
        with pytest.raises(ValueError):
            bad.check()


def test_structural_tag_enforces_a_structure_from_its_trigger(llm):
    """vLLM's structural tag: free text; from a trigger on, begin + schema + end."""
    tag = {
        "structures": [{"begin": "<fn=a>", "schema": {"enum": [1, 2]}, "end": "</fn>"}],
        "triggers": ["<fn="],
    }
    so = StructuredOutputs.from_dict({"structural_tag": json.dumps(tag)})
    grammars = llm.engine.grammars

    def accepts(text: str) -> bool:
        m = grammars.matcher(so, []).m
        return m.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False))

    tok = llm.tokenizer
    if tok.decode(tok.encode("<fn=a>", add_special_tokens=False)) == "<fn=a>":  # byte BPE
        # (WordPiece decodes it spaced out: "< fn = a >" never writes the trigger.)
        assert accepts("free text <fn=a>2</fn> more") and accepts("no call at all")
        assert not accepts("text <fn=a>3</fn>") and not accepts("text <fn=b>")
    with pytest.raises(ValueError, match="starts with no trigger"):
        StructuredOutputs(
            structural_tag={"structures": [{"begin": "x", "end": ""}], "triggers": ["<"]}
        )
    (out,) = _one(llm, temperature=1.0, seed=3, max_tokens=20, structured_outputs=so)
    assert "<fn=" not in out.text or re.search(r"<fn=a>[12]</fn>", out.text), out.text


def test_a_check_past_its_time_bound_is_refused():
    """The gateway bounds a constraint's check (gateway/core.py COMPILE_TIMEOUT_S)."""
    import asyncio

    from gateway.core import within

    async def slow():
        await asyncio.sleep(1)

    with pytest.raises(ValueError, match="took longer than 0.05 s"):
        asyncio.run(within(slow(), 0.05))
    asyncio.run(within(asyncio.sleep(0), 0.05))


def test_the_stop_token_adds_no_text(llm):
    """EOS ends the output without its text, even with special tokens kept (as vLLM)."""
    (out,) = _one(
        llm, temperature=0.0, skip_special_tokens=False, structured_outputs={"choice": ["yes"]}
    )
    assert out.finish_reason == "stop" and out.text.strip() == "yes", out.text
