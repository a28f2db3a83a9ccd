"""Tool-call parsers (hermes, llama3_json, mistral, qwen3_coder): realistic answers of each
model family parse into the right calls and content, and a call that does not parse or
names an unknown function stays text; streamed in any split, the deltas add up to the
same. The grammars: test_tool_grammars.py."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tools import Function, functions_from_tools, tool_parser
from tests.helpers.tool_calls import CET, PARIS, parser, write

OSLO = ("get_weather", {"city": "Oslo"})
SAME = object()  # the content is the text itself: no call came of it


def case(fmt: str, text: str, *calls: tuple[str, dict], content: object = "") -> tuple:
    """(format, model output, content, calls)."""
    return fmt, text, text.strip() if content is SAME else content, list(calls)


ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
QWEN_TIME = "<tool_call>\n<function=get_time>\n{}</function>\n</tool_call>"
# Answers as the model families write them; every one also streams to the same result.
EXAMPLES = [
    case("hermes", write("hermes", [PARIS]), PARIS),
    case(
        "hermes",
        "I'll look both up.\n\n" + write("hermes", [PARIS, CET]),
        PARIS,
        CET,
        content="I'll look both up.",
    ),
    case(
        "hermes",
        '<tool_call>{"name":"get_time","arguments":{"zone":"CET","utc":true}}</tool_call>',
        CET,
    ),
    case(
        "hermes",
        '<tool_call>\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n</tool_call>',
        OSLO,
    ),
    case(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}]b{\\"ü"}}\n</tool_call>',
        ("get_weather", {"city": 'a}]b{"ü'}),
    ),
    case(
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
        OSLO,
    ),
    case(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        OSLO,
    ),
    case("hermes", ONE.removesuffix("</tool_call>"), OSLO),  # the output ended before the tag
    case("hermes", ONE + "\nDone, see above.", OSLO, content="Done, see above."),
    case(
        "hermes",
        '<tool_call>\n{"name": "book_flight", "arguments": {}}\n</tool_call>',
        content=SAME,
    ),
    case(
        "hermes",
        "A <tool_call>\nget_weather()\n</tool_call> " + ONE,
        OSLO,
        content="A <tool_call>\nget_weather()\n</tool_call>",
    ),
    case("hermes", "Use the <tool> tag, or <tool_call", content=SAME),
    case("llama3_json", write("llama3_json", [PARIS]), PARIS),
    case("llama3_json", "<|python_tag|>" + write("llama3_json", [PARIS, CET]), PARIS, CET),
    case("llama3_json", '\n\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', OSLO),
    case(
        "llama3_json", write("llama3_json", [CET]) + "\n\nLet me know.", CET, content="Let me know."
    ),
    case("llama3_json", "The weather in Paris is sunny.", content=SAME),
    case("llama3_json", '{"answer": 42}', content=SAME),
    case("llama3_json", '{"name": "book_flight", "parameters": {"to": "NYC"}}', content=SAME),
    case("llama3_json", "<b>bold</b> text", content=SAME),
    case("mistral", write("mistral", [PARIS]), PARIS),
    case(
        "mistral",
        "Let me check.[TOOL_CALLS] " + write("mistral", [PARIS, CET])[12:],
        PARIS,
        CET,
        content="Let me check.",
    ),
    case("mistral", write("mistral-named", [PARIS]), PARIS),
    case("mistral", write("mistral-named", [PARIS, CET]), PARIS, CET),
    case(
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[x], y"}}] Done.',
        ("get_weather", {"city": "[x], y"}),
        content="Done.",
    ),
    case("mistral", '[TOOL_CALLS]book_flight[ARGS]{"to": "NYC"}', content=SAME),
    case(
        "mistral",
        write("mistral", [CET])[:-1] + ', {"name": "nope", "arguments": {}}]',
        CET,
        content=', {"name": "nope", "arguments": {}}]',
    ),
    case("mistral", "Arrays look like [1, 2]. [TOOL_CALLS] nothing", content=SAME),
    case("qwen3_coder", write("qwen3_coder", [PARIS]), PARIS),
    case(
        "qwen3_coder",
        "Checking both.\n" + write("qwen3_coder", [PARIS, CET]),
        PARIS,
        CET,
        content="Checking both.",
    ),
    case(
        "qwen3_coder",
        write("qwen3_coder", [("get_weather", {"city": "New\nYork", "unit": "c"})]),
        ("get_weather", {"city": "New\nYork", "unit": "c"}),
    ),
    case(
        "qwen3_coder",
        QWEN_TIME.format(
            "<parameter=utc>\nTrue\n</parameter>\n<parameter=zone>\n123\n</parameter>\n"
        ),
        ("get_time", {"utc": True, "zone": "123"}),
    ),
    case("qwen3_coder", QWEN_TIME.format(""), ("get_time", {})),
    case(
        "qwen3_coder",
        QWEN_TIME.format("<parameter=zone>\nUTC\n</parameter>\n").replace("</function>\n", ""),
        ("get_time", {"zone": "UTC"}),
    ),
    case("qwen3_coder", write("qwen3_coder", [("book_flight", {"to": "NYC"})]), content=SAME),
]


@pytest.mark.parametrize("fmt,text,content,calls", EXAMPLES)
def test_parse(fmt, text, content, calls):
    got_content, got_calls = parser(fmt).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def collect(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Stream ``pieces``; check the deltas' order and return (content, [(name, args)])."""
    stream = parser(fmt).stream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.index == len(calls):
                assert call.name is not None
                calls.append((call.name, ""))
            assert call.index == len(calls) - 1 and (call.name is None or not calls[-1][1])
            calls[-1] = (calls[-1][0], calls[-1][1] + call.arguments)
    return content, calls


def splits(text: str, seed: int) -> list[str]:
    rng, pieces, pos = random.Random(seed), [], 0
    while pos < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("fmt,text,content,calls", EXAMPLES)
def test_stream_matches_parse(fmt, text, content, calls):
    for pieces in [list(text), [text]] + [splits(text, seed) for seed in range(4)]:
        got_content, got_calls = collect(fmt, pieces)
        assert got_content == content, pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, pieces


MALFORMED = [  # a call that does not parse stays text, with no call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'),
    ("hermes", 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"),
]


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_stays_text(fmt, text):
    assert parser(fmt).parse(text) == (text.strip(), [])


def test_qwen3_coder_values_typed_by_schema():
    schema = {
        "properties": {
            "q": {"type": "string"},
            "n": {"type": "number"},
            "f": {"type": "object"},
            "t": {"type": "array"},
            "x": {"type": "null"},
            "k": {"type": "integer"},
        }
    }
    values = {"q": "\n  two\nlines \n", "n": "2.5", "f": '{"a": [1]}', "t": "[1, 2]", "x": "null"}
    values |= {"k": "many", "other": "7", "note": "plain words", "inf": "Infinity"}
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=search>\n{params}</function>\n</tool_call>"
    _, (call,) = tool_parser("qwen3_coder")([Function("search", schema)]).parse(text)
    assert json.loads(call.arguments) == {
        **{"q": "\n  two\nlines \n", "n": 2.5, "f": {"a": [1]}, "t": [1, 2], "x": None},
        **{"k": "many", "other": 7, "note": "plain words", "inf": "Infinity"},
    }


def test_stream_shows_text_and_arguments_early():
    stream = parser("hermes").stream()
    assert stream.feed("Hello <tool").content == "Hello"
    assert stream.feed("box> and ").content == " <toolbox> and"
    delta = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert delta.content == "" and delta.calls[0].name == "get_weather"
    assert delta.calls[0].arguments == '{"city": "Pa'
    early = {
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>",
    }
    for fmt, text in early.items():
        (call,) = parser(fmt).stream().feed(text).calls
        assert call.name == "get_weather" and call.arguments in ('{"city": "Pa', '{"city": "Paris"')
    stream = parser("mistral").stream()
    assert stream.feed('[TOOL_CALLS]get_weather[ARGS]{"ci').calls[0].arguments == '{"ci'


def test_functions_from_tools():
    tool = {"type": "function", "function": {"name": "get_time", "description": "Time"}}
    assert functions_from_tools([tool]) == [Function("get_time", {}, "Time")]
    bad = [
        ([tool, tool], r"tools\[1\].function.name 'get_time' is given twice"),
        ([{"type": "retrieval"}], r'tools\[0\] must be an object with "type": "function"'),
        ([tool, {"type": "function"}], r"tools\[1\].function must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
        ("get_time", "tools must be a list"),
    ]
    for tools, message in bad:
        with pytest.raises(ValueError, match=message):
            functions_from_tools(tools)
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, qwen3_coder"):
        tool_parser("pythonic")
