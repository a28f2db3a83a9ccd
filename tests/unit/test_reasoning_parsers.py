"""Reasoning parsers split thinking from the answer as vLLM's do, and a stream fed in any
chunks adds up to exactly what ``split`` gives for the whole output."""

from __future__ import annotations

import random

import pytest

from gateway.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    opens_thinking,
    reasoning_parser,
)


def parse(name: str, text: str, **kwargs) -> tuple[str | None, str | None]:
    return reasoning_parser(name)(**kwargs).split(text)


def streamed(parser: ReasoningParser, chunks: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream()
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    return reasoning or None, content or None


@pytest.mark.parametrize("name", ["deepseek_r1", "nemotron_v3"])
@pytest.mark.parametrize("started", [False, True])
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nplan\n</think>\n\nanswer", ("\nplan", "answer")),
        ("plan\n</think>\n\nanswer", ("plan", "answer")),
        ("plan</think>answer </think>", ("plan", "answer </think>")),
        ("plan, never finished\n", ("plan, never finished", None)),
        ("</think>\n\nanswer", (None, "answer")),
        ("plan</think>\n \n", ("plan", None)),
        ("plan </thi", ("plan </thi", None)),
        ("<th", ("<th", None)),
        ("", (None, None)),
    ],
)
def test_thinking_first_parsers(name, started, text, expected):
    assert parse(name, text, started=started) == expected


@pytest.mark.parametrize(
    "text, started, expected",
    [
        ("<think>\nplan\n</think>\n\nanswer", False, ("\nplan", "answer")),
        ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
        ("<think>plan, never finished", False, ("plan, never finished", None)),
        ("plan, never finished\n", True, ("plan, never finished", None)),
        ("just an answer\n", False, (None, "just an answer\n")),
        (
            "  an answer </think> with a stray tag",
            False,
            (None, "  an answer </think> with a stray tag"),
        ),
        ("<think></think>\n\nanswer", False, (None, "answer")),
        ("<thin", False, (None, "<thin")),
    ],
)
def test_qwen3_thinks_only_when_opened(text, started, expected):
    assert parse("qwen3", text, started=started) == expected


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think></think>answer", "answer"),
        ("<think>\n\n</think>\n\nanswer", "answer"),
        ("answer\n", "answer\n"),
        ("<think>not empty</think>answer", "<think>not empty</think>answer"),
        ("<think>\n", "<think>\n"),
        ("answer </think>", "answer </think>"),
    ],
)
def test_disabled_thinking_is_all_content(name, text, expected):
    assert parse(name, text, enabled=False) == (None, expected)
    assert parse(name, text, enabled=False, started=True) == (None, expected)


def test_stream_holds_back_only_a_possible_tag_or_trailing_newline():
    stream = reasoning_parser("deepseek_r1")().stream()
    assert stream.feed("<thi") == ("", "")  # could still be the start tag
    assert stream.feed("nk>plan <") == ("plan ", "")
    assert stream.feed("b> more\n") == ("<b> more", "")
    assert stream.feed("\n") == ("\n", "")  # the earlier newline was not the last
    assert stream.feed("</think>\n ") == ("", "")
    assert stream.feed(" The answer") == ("", "The answer")
    assert stream.feed(" <think>") == ("", " <think>")
    assert stream.finish() == ("", "")


def test_qwen3_without_tags_streams_content_at_once():
    stream = reasoning_parser("qwen3")().stream()
    assert stream.feed("<") == ("", "")
    assert stream.feed("b>bold") == ("", "<b>bold")
    assert stream.feed(" </think>") == ("", " </think>")


TEXTS = [
    "",
    "<think>\nplan\n\nmore\n</think>\n\nanswer\n",
    "plan\n</think>\n\n  answer </think> <think>",
    "<think></think>answer",
    "<think>\n\n</think>\n\nanswer",
    "<think>not empty</think>answer",
    "<<think>x</</think></think>y",
    "plan never finished\n\n",
    "just an answer\n",
    "<th",
    "plan </thi",
    "\n\n</think>\n\n",
    "<think>\n</think",
    "a\n<\n</\n</t\n</think\n</think>\n<think>\n",
]
CONFIGS = [
    (name, enabled, started)
    for name in sorted(REASONING_PARSERS)
    for enabled in (True, False)
    for started in (False, True)
]


@pytest.mark.parametrize("name, enabled, started", CONFIGS)
def test_stream_char_by_char_equals_split(name, enabled, started):
    parser = reasoning_parser(name)(enabled=enabled, started=started)
    for text in TEXTS:
        assert streamed(parser, list(text)) == parser.split(text), text


@pytest.mark.parametrize("name, enabled, started", CONFIGS)
def test_stream_in_random_chunks_equals_split(name, enabled, started):
    parser = reasoning_parser(name)(enabled=enabled, started=started)
    rng = random.Random(f"{name}-{enabled}-{started}")
    for text in TEXTS:
        for _ in range(20):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert "".join(chunks) == text
            assert streamed(parser, chunks) == parser.split(text), chunks


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("<|Assistant|><think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("<think>old</think> user text <think>", True),
        ("", False),
    ],
)
def test_opens_thinking(prompt, expected):
    assert opens_thinking(prompt) is expected


def test_registry_names_and_unknown_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "nemotron_v3", "qwen3"]
    assert all(reasoning_parser(n).name == n for n in REASONING_PARSERS)
    with pytest.raises(ValueError, match="deepseek_r1, nemotron_v3, qwen3"):
        reasoning_parser("granite")
