"""mistral: ``[TOOL_CALLS]`` then a JSON array of calls,
``[{"name": "f", "arguments": {...}}, ...]``; newer models (tokenizer v11 on) write each
call as ``[TOOL_CALLS]f[ARGS]{...}``. Text may come before and between."""

from __future__ import annotations

import re
from collections.abc import Callable

from gateway.tools.base import ToolCall, ToolParser, ToolStream, partial_marker
from gateway.tools.grammar import (
    alternatives,
    chosen,
    frame,
    json_value,
    lit,
    object_schema,
    repeated,
)
from gateway.tools.json_calls import DECODER, CallReader, JsonScanner, read_call

CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
BETWEEN = " \t\r\n,"  # what separates the array's calls
# What may stand before [ARGS]: a function's name (a prefix of one, while streaming).
NAME = re.compile(r"\s*[a-zA-Z0-9_-]{0,64}")


class MistralParser(ToolParser):
    """Each ``[TOOL_CALLS]`` starts calls, in either form; the text up to the next marker
    that is not a call is content (with the marker, when no call came of it)."""

    name = "mistral"
    markers = (CALLS, ARGS)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        first, *segments = text.split(CALLS)
        content, calls = [first], []
        for segment in segments:
            found, rest = self._segment(segment)
            calls += found
            content.append(rest)
        return "".join(content).strip(), calls

    def _segment(self, segment: str) -> tuple[list[ToolCall], str]:
        """The calls after one marker, and the text left as content."""
        body = segment.lstrip()
        if body.startswith("["):
            return self._array(segment, len(segment) - len(body) + 1)
        call, rest = self._named(segment)
        return ([call], rest) if call else ([], CALLS + segment)

    def _array(self, segment: str, pos: int) -> tuple[list[ToolCall], str]:
        calls, last = [], pos
        while True:
            while pos < len(segment) and segment[pos] in BETWEEN:
                pos += 1
            if segment.startswith("]", pos):
                return calls, segment[pos + 1 :]
            call, end = (
                read_call(self, segment, pos) if segment.startswith("{", pos) else (None, pos)
            )
            if call is None:
                return calls, segment[last:] if calls else CALLS + segment
            calls.append(call)
            last = pos = end

    def _named(self, segment: str) -> tuple[ToolCall | None, str]:
        at = segment.find(ARGS)
        if at < 0 or not NAME.fullmatch(segment[:at]):
            return None, ""
        body = segment[at + len(ARGS) :].lstrip()
        try:
            arguments, end = DECODER.raw_decode(body)
        except ValueError:
            return None, ""
        return self.make_call(segment[:at].strip(), arguments), body[end:]

    def stream(self) -> ToolStream:
        return _MistralStream(self)

    def grammar(self, choice: str | None, parallel: bool, token: Callable[[str], str]) -> str:
        functions, parallel = chosen(self.functions, choice, parallel)
        rules = [
            f"array: {lit(' ')}? {lit('[')} {repeated('item', lit(', '), parallel)} {lit(']')}",
            alternatives("item", len(functions)),
            alternatives("named", len(functions)),
        ]
        for i, function in enumerate(functions):
            head = lit(f'{{"name": {lit(function.name)}, "arguments": ')
            schema = json_value(object_schema(function.parameters))
            rules.append(f"item_{i}: {head} {schema} {lit('}')}")
            rules.append(f"named_{i}: {lit(function.name)} {token(ARGS)} {schema}")
        return frame(rules, token(CALLS), "(array | named)", "", choice, parallel)


class _MistralStream(ToolStream):
    """Modes: text (until a marker), after (which form?), array (between its calls),
    item (a call of the array, to a reader), name (before [ARGS]), named (the arguments
    object). ``_raw`` holds the text consumed since the marker or the last call: it is
    shown as content if what follows is not a call. Calls never reach past the next
    marker, as in ``parse``."""

    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self._mode, self._raw = "text", ""
        self._reader: CallReader | None = None
        self._scan = JsonScanner()

    def advance(self, final: bool) -> None:
        steps = {
            "text": self._text,
            "after": self._after,
            "array": self._array,
            "item": self._item,
            "name": self._before_args,
            "named": self._arguments,
        }
        while steps[self._mode](final):
            pass

    def _piece(self, final: bool) -> tuple[str, bool]:
        """The buffered text before the next marker (left buffered), and whether the
        calls' segment ends there."""
        text, found = self.take_until(CALLS, final)
        if found:
            self.buf = CALLS + self.buf
        return text, found or final

    def _fail(self) -> bool:
        """What was read since the marker (or the last call) is no call: it is text."""
        self.text(self._raw)
        self._raw, self._mode = "", "text"
        return True

    def _skip(self, chars: str | None) -> str:
        """Move leading ``chars`` (whitespace when None) from the buffer to ``_raw``."""
        rest = self.buf.lstrip(chars)
        self._raw += self.buf[: len(self.buf) - len(rest)]
        self.buf = rest
        return rest

    def _text(self, final: bool) -> bool:
        text, found = self.take_until(CALLS, final)
        self.text(text)
        if found:
            self._mode, self._raw = "after", CALLS
        return found

    def _after(self, final: bool) -> bool:
        rest = self._skip(None)
        if not rest:
            return self._fail() if final else False
        if rest.startswith("["):
            self.buf, self._raw = rest[1:], self._raw + "["
        self._mode = "array" if rest.startswith("[") else "name"
        return True

    def _array(self, final: bool) -> bool:
        rest = self._skip(BETWEEN)
        if not rest:
            return self._fail() if final else False
        if rest.startswith("]"):
            self.buf, self._raw, self._mode = rest[1:], "", "text"
        elif rest.startswith("{"):
            self._reader, self._mode = CallReader(self.parser), "item"
        else:
            return self._fail()
        return True

    def _item(self, final: bool) -> bool:
        text, ends = self._piece(final)
        reader = self._reader
        self.emit(*reader.feed(text))
        if reader.state == "failed" or (ends and reader.state == "head"):
            self.buf, self._reader = reader.raw + self.buf, None
            return self._fail()
        if reader.state == "done":
            self.buf, self._reader = reader.rest + self.buf, None
            self._raw, self._mode = "", "array"
        elif ends:  # a call cut off by the marker or the end
            self._reader, self._raw, self._mode = None, "", "text"
        else:
            return False
        self.index += 1
        return True

    def _before_args(self, final: bool) -> bool:
        at = self.buf.find(ARGS)
        held = 0 if final or at >= 0 else partial_marker(self.buf, ARGS)
        name = self.buf[:at] if at >= 0 else self.buf[: len(self.buf) - held]
        if not NAME.fullmatch(name) or (at < 0 and final):
            return self._fail()
        if at < 0:
            return False
        rest = self.buf[at + len(ARGS) :].lstrip()
        if not rest:
            return self._fail() if final else False
        if not rest.startswith("{") or name.strip() not in self.parser.functions:
            return self._fail()
        self.buf, self._raw, self._mode = rest, "", "named"
        self._scan = JsonScanner()
        self.emit(name.strip(), "")
        return True

    def _arguments(self, final: bool) -> bool:
        text, ends = self._piece(final)
        end = self._scan.scan(text, 0)
        if end >= 0:
            self.buf = text[end:] + self.buf
            text = text[:end]
        self.emit(None, text)
        if end < 0 and not ends:
            return False
        self.index += 1
        self._mode = "text"
        return True
