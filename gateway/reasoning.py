"""Reasoning parsers (vLLM's ``--reasoning-parser`` names): split a model's output into
its thinking (``message.reasoning``) and its answer (``message.content``), whole or as
a stream of deltas. ``split`` runs the stream, so both always agree."""

from __future__ import annotations

from typing import ClassVar

from gateway.tools.base import partial_marker

# Where a stream stands in the output.
_HEAD = "head"  # the first characters: is there a leading tag?
_REASONING = "reasoning"  # inside the thinking, watching for the end tag
_CONTENT_LEAD = "content_lead"  # just past the thinking: leading whitespace is dropped
_CONTENT = "content"  # the answer, passed on as it comes


class ReasoningParser:
    """One request's parser. ``enabled=False``: thinking was switched off for the request
    (``chat_template_kwargs={"enable_thinking": false}``), so everything is content.
    ``started``: the prompt ends inside an open start tag (see ``opens_thinking``)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Output with no start tag is thinking even when the prompt did not open it.
    opens_unprompted: ClassVar[bool] = True

    def __init__(self, *, enabled: bool = True, started: bool = False):
        self.enabled = enabled
        self.started = started

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self) -> ReasoningStream:
        """A fresh incremental splitter for one output."""
        return ReasoningStream(self)

    def opening(self, text: str, final: bool) -> tuple[int, str] | None:
        """How the output opens: (characters to drop, next state), or None while the
        text seen so far could still be the start of a tag."""
        if not self.enabled:
            n = self._empty_pair(text)
            if n is None and not final:
                return None
            return (n, _CONTENT_LEAD) if n else (0, _CONTENT)
        if _proper_prefix(text, self.start) and not final:
            return None
        if text.startswith(self.start):
            return len(self.start), _REASONING
        return 0, _REASONING if self.opens_unprompted or self.started else _CONTENT

    def _empty_pair(self, text: str) -> int | None:
        """Length of a leading empty start/end pair (whitespace inside allowed), 0 when
        there is none, None while undecided."""
        if _proper_prefix(text, self.start):
            return None
        if not text.startswith(self.start):
            return 0
        rest = text[len(self.start) :].lstrip()
        if rest.startswith(self.end):
            return len(text) - len(rest) + len(self.end)
        return None if _proper_prefix(rest, self.end) else 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Everything before the end tag is thinking (the template opens it in the prompt)."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Thinking only when opened (by the output or the prompt): Qwen3 with thinking off
    writes no tags, and a stray end tag is then just text."""

    name = "qwen3"
    opens_unprompted = False


class NemotronV3ReasoningParser(DeepSeekR1ReasoningParser):
    """As DeepSeek-R1; with thinking disabled the template puts an empty pair in the
    prompt and the whole output is content."""

    name = "nemotron_v3"


class ReasoningStream:
    """Splits an output given piece by piece. Holds back only what could still change
    meaning: a suffix that may begin a tag, and a trailing newline of the thinking (it is
    dropped if the thinking ends there)."""

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._state = _HEAD
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) after the next piece of decoded text."""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back; the output is complete."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == _HEAD:
            opening = self._parser.opening(self._buf, final)
            if opening is None:
                return "", ""
            drop, self._state = opening
            self._buf = self._buf[drop:]
        if self._state == _REASONING:
            reasoning = self._reason(final)
        return reasoning, self._content()

    def _reason(self, final: bool) -> str:
        """Reasoning that is certain now; moves on to content at the end tag."""
        end = self._parser.end
        i = self._buf.find(end)
        if i >= 0:
            text, self._buf = self._buf[:i], self._buf[i + len(end) :]
            self._state = _CONTENT_LEAD
            return text.removesuffix("\n")
        if final:
            text, self._buf = self._buf, ""
            return text.removesuffix("\n")
        hold = partial_marker(self._buf, end)
        text = self._buf[: len(self._buf) - hold]
        if text.endswith("\n"):
            text, hold = text[:-1], hold + 1
        self._buf = self._buf[len(self._buf) - hold :] if hold else ""
        return text

    def _content(self) -> str:
        if self._state == _CONTENT_LEAD:
            self._buf = self._buf.lstrip()
            if self._buf:
                self._state = _CONTENT
        if self._state != _CONTENT:
            return ""
        text, self._buf = self._buf, ""
        return text


def _proper_prefix(text: str, tag: str) -> bool:
    return len(text) < len(tag) and tag.startswith(text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, NemotronV3ReasoningParser)
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for a ``--reasoning-parser`` name."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None


def opens_thinking(prompt_text: str) -> bool:
    """The prompt ends inside open thinking: its last start tag follows its last end tag
    (templates such as DeepSeek-R1's and Nemotron's end the prompt with ``<think>\\n``)."""
    start, end = ReasoningParser.start, ReasoningParser.end
    return prompt_text.rfind(start) > prompt_text.rfind(end)
