"""llama3_json (Llama 3.1 / 3.2): the answer itself is the call,
``{"name": "f", "parameters": {...}}``, optionally after ``<|python_tag|>``; several
are separated by ``; ``. An answer that starts otherwise is plain text."""

from __future__ import annotations

from collections.abc import Callable

from gateway.tools.base import ToolCall, ToolParser, ToolStream
from gateway.tools.grammar import (
    alternatives,
    chosen,
    json_value,
    lit,
    object_schema,
    repeated,
)
from gateway.tools.json_calls import CallReader, read_call

TAG = "<|python_tag|>"
_BETWEEN = " \t\r\n;"  # what separates calls
# Plain text: anything that does not start (after whitespace) like a call.
_PLAIN = r"PLAIN: /(?s:.*)/ & ~/[ \t\r\n]*(\{|<\|python_tag\|>)(?s:.*)/"


class Llama3JsonParser(ToolParser):
    """Calls at the start of the answer; from the first thing that is not a call on,
    the rest is content."""

    name = "llama3_json"
    markers = (TAG,)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        rest = text.lstrip()
        if rest.startswith(TAG):
            rest = rest[len(TAG) :]
        elif not rest.startswith("{"):
            return text.strip(), []
        calls, pos = [], 0
        while True:
            while pos < len(rest) and rest[pos] in _BETWEEN:
                pos += 1
            call, end = read_call(self, rest, pos) if rest.startswith("{", pos) else (None, pos)
            if call is None:
                return rest[pos:].strip(), calls
            calls.append(call)
            pos = end

    def stream(self) -> ToolStream:
        return _Llama3Stream(self)

    def grammar(self, choice: str | None, parallel: bool, token: Callable[[str], str]) -> str:
        functions, parallel = chosen(self.functions, choice, parallel)
        calls = f"{token(TAG)}? {repeated('call', lit('; '), parallel)}"
        lines = ["%llguidance {}"]
        lines += [f"start: {calls}"] if choice is not None else [f"start: PLAIN | {calls}", _PLAIN]
        lines.append(alternatives("call", len(functions)))
        for i, function in enumerate(functions):
            head = lit(f'{{"name": {lit(function.name)}, "parameters": ')
            schema = json_value(object_schema(function.parameters))
            lines.append(f"call_{i}: {head} {schema} {lit('}')}")
        return "\n".join(lines) + "\n"


class _Llama3Stream(ToolStream):
    """start: is the answer calls or text? calls: the calls, one reader each; text: the
    rest is content."""

    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self._mode = "start"
        self._reader: CallReader | None = None

    def advance(self, final: bool) -> None:
        steps = {"start": self._start, "calls": self._calls, "text": self._text}
        while steps[self._mode](final):
            pass

    def _start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(TAG):
            self.buf, self._mode = head[len(TAG) :], "calls"
            return True
        if not final and TAG.startswith(head):  # nothing yet, or a part of the tag
            return False
        self.buf, self._mode = head, "calls" if head.startswith("{") else "text"
        return True

    def _calls(self, final: bool) -> bool:
        if self._reader is None:
            self.buf = self.buf.lstrip(_BETWEEN)
            if not self.buf:
                return False
            if not self.buf.startswith("{"):
                self._mode = "text"
                return True
            self._reader = CallReader(self.parser)
        reader = self._reader
        self.emit(*reader.feed(self.buf))
        self.buf = ""
        if reader.state == "failed" or (final and reader.state == "head"):
            self.buf, self._mode, self._reader = reader.raw, "text", None
            return True
        if reader.state == "done" or final:  # final: a call cut off
            self.buf, self._reader = reader.rest, None
            self.index += 1
            return reader.state == "done"
        return False

    def _text(self, final: bool) -> bool:
        self.text(self.buf)
        self.buf = ""
        return False
