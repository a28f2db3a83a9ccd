"""Calls written as a JSON object ``{"name": "f", "arguments": {...}}`` (hermes, llama3_json,
mistral's array): read whole, or as the text arrives, streaming the arguments' JSON text
while it grows."""

from __future__ import annotations

import json
import re

from gateway.tools.base import ToolCall, ToolParser

# The head of a call whose arguments can stream: the name, then the arguments object opens.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
_FIRST = re.compile(r"\s*(\S)")  # where the object should open


def _no_constant(name: str) -> None:
    # NaN and Infinity are not JSON; json.dumps would write them back.
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_no_constant)


def loads(text: str) -> object:
    """The JSON value of ``text``, or ValueError (strict: no NaN / Infinity)."""
    value, end = DECODER.raw_decode(text.strip())
    if end != len(text.strip()):
        raise ValueError("extra text after the JSON value")
    return value


def call_from_object(parser: ToolParser, obj: object) -> ToolCall | None:
    """The call an object describes; "parameters" (Llama) stands for "arguments", and
    arguments given as JSON text are read."""
    if not isinstance(obj, dict):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments)
        except ValueError:
            return None
    return parser.make_call(obj.get("name"), arguments)


def read_call(parser: ToolParser, text: str, pos: int) -> tuple[ToolCall | None, int]:
    """The call object at ``text[pos]`` and the index after it; (None, pos) if none."""
    try:
        obj, end = DECODER.raw_decode(text, pos)
    except ValueError:
        return None, pos
    call = call_from_object(parser, obj)
    return call, end if call else pos


class JsonScanner:
    """Nesting depth through JSON text given in pieces (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, until: int) -> int:
        """Read ``text``; the index just after the bracket that closes back to depth
        ``until``, or -1 when all of it was read without that."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == until:
                    return i + 1
        return -1


class CallReader:
    """One call object read as it arrives. Once the head ``{"name": "f", "arguments": {``
    is in, the call is committed and its arguments stream as raw JSON text; an object in
    another shape is held whole and read at its end. ``state``: head, args, tail (after
    the arguments), done, or failed (not a call of an offered function: ``raw`` holds all
    the text fed, to show as content)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.raw = ""  # the object's text (all text fed, until done)
        self.rest = ""  # text fed after the object's end
        self.state = "head"
        self._scan = JsonScanner()

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the call's name when it becomes known, the next arguments fragment)."""
        start = len(self.raw)
        self.raw += text
        if self.state == "head":
            return self._head(start)
        if self.state == "args":
            return None, self._args(start)
        if self.state == "tail":
            self._tail(start)
        elif self.state == "done":
            self.rest, self.raw = self.rest + text, self.raw[:start]
        return None, ""

    def end(self) -> str:
        """Nothing owed at a block's end: the arguments are the model's own text."""
        return ""

    def _head(self, start: int) -> tuple[str | None, str]:
        first = _FIRST.match(self.raw)
        if first and first.group(1) != "{":
            self.state = "failed"
            return None, ""
        head = _HEAD.match(self.raw)
        if head:
            return self._commit(head)
        end = self._scan.scan(self.raw[start:], 0)
        return (None, "") if end < 0 else self._whole(start + end)

    def _commit(self, head: re.Match) -> tuple[str | None, str]:
        try:
            name = json.loads(head.group(1))
        except ValueError:
            name = None
        if name not in self.parser.functions:
            self.state = "failed"
            return None, ""
        self.state = "args"
        self._scan = JsonScanner()
        self._scan.scan(self.raw[: head.end() - 1], 0)  # inside the call object: depth 1
        return name, self._args(head.end() - 1)

    def _args(self, start: int) -> str:
        piece = self.raw[start:]
        end = self._scan.scan(piece, 1)
        if end < 0:
            return piece
        self.state = "tail"
        self._tail(start + end)
        return piece[:end]

    def _tail(self, start: int) -> None:
        end = self._scan.scan(self.raw[start:], 0)
        if end >= 0:
            self._done(start + end)

    def _whole(self, end: int) -> tuple[str | None, str]:
        try:
            call = call_from_object(self.parser, loads(self.raw[:end]))
        except ValueError:
            call = None
        if call is None:
            self.state = "failed"
            return None, ""
        self._done(end)
        return call.name, call.arguments

    def _done(self, end: int) -> None:
        self.state = "done"
        self.raw, self.rest = self.raw[:end], self.raw[end:]
