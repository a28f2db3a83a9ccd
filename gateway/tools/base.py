"""Tool calls in a model's answer: the request's functions, the calls found, and the parser
interface each output format implements (whole text, streamed text, and a grammar that
makes the model write the format right)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class Function:
    """One entry of the request's ``tools`` (type "function")."""

    name: str
    parameters: dict  # JSON schema of the arguments ({} = any object)
    description: str = ""


@dataclass
class ToolCall:
    """A call found in the answer."""

    name: str
    arguments: str  # JSON text of an object


@dataclass
class CallDelta:
    """A piece of one call, streamed."""

    index: int  # the call's position in this answer: 0, 1, ...
    name: str | None  # set on the first delta of a call only
    arguments: str  # a fragment of the arguments' JSON text ("" allowed)


@dataclass
class StreamDelta:
    """What one piece of output adds: text to show, and pieces of calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser:
    """One output format (vLLM's ``--tool-call-parser`` name). A call of a function the
    request did not offer, or one that does not parse, stays in the content as text."""

    name: ClassVar[str]
    # The tag texts the format uses; the server keeps special tokens in the decoded text
    # when one of them is a special token, so that the parsers see them.
    markers: ClassVar[tuple[str, ...]]

    def __init__(self, functions: list[Function]):
        self.functions = {f.name: f for f in functions}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls): the text outside the calls, stripped, and the calls."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        """A parser for this answer's output as it is decoded."""
        raise NotImplementedError

    def grammar(self, choice: str | None, parallel: bool, token: Callable[[str], str]) -> str:
        """Lark text for llguidance. ``choice`` None: free text, a call enforced from its
        start marker on; "required": one or more calls (one unless ``parallel``) and
        nothing else; a function's name: one call of it. ``token(marker)`` is the Lark
        fragment for a marker (a literal, or ``<[id]>`` for a special token)."""
        raise NotImplementedError

    def make_call(self, name: object, arguments: object) -> ToolCall | None:
        """The call, if it names an offered function and its arguments are an object."""
        if not isinstance(name, str) or name not in self.functions:
            return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """Incremental parsing of one answer: the deltas ``feed`` and ``finish`` return are
    the same for any split of the text, and add up to what ``parse`` makes of it: the
    same content, names and calls, each call's argument fragments joining to JSON text
    of the same object (the model's own text; ``parse`` writes it anew). The exception: a call that breaks after its name was sent (cut off, bad JSON inside)
    cannot be taken back; it stays a call, its arguments possibly unreadable. Content
    is held back only while it could be the start of a marker, or is whitespace that
    ``parse`` would strip (leading, or trailing so far)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""  # text received, not yet consumed
        self.index = 0  # the index of the call being read
        self._out = StreamDelta()
        self._started = False  # some content shown
        self._space = ""  # trailing whitespace of the content, held

    def feed(self, text: str) -> StreamDelta:
        """The next piece of decoded output text."""
        self.buf += text
        self.advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """End of output: flush what was held back."""
        self.advance(final=True)
        self.buf = ""
        return self._take()

    def advance(self, final: bool) -> None:
        """Consume ``buf`` as far as it can be decided (all of it when ``final``)."""
        raise NotImplementedError

    def text(self, text: str) -> None:
        """Show ``text`` as content, less the whitespace ``parse`` strips at the ends."""
        if not self._started:
            text = text.lstrip()
        core = text.rstrip()
        if not core:
            self._space += text
            return
        self._out.content += self._space + core
        self._space = text[len(core) :]
        self._started = True

    def emit(self, name: str | None, arguments: str) -> None:
        """A piece of the current call (merged with the last delta when it is the same call)."""
        if name is None and not arguments:
            return
        calls = self._out.calls
        if name is None and calls and calls[-1].index == self.index:
            calls[-1].arguments += arguments
        else:
            calls.append(CallDelta(self.index, name, arguments))

    def take_until(self, marker: str, final: bool) -> tuple[str, bool]:
        """Take the buffered text before ``marker`` and the marker itself: (text, True);
        without the marker, the text that cannot be the start of one: (text, False)."""
        at = self.buf.find(marker)
        if at >= 0:
            text, self.buf = self.buf[:at], self.buf[at + len(marker) :]
            return text, True
        cut = len(self.buf) - (0 if final else partial_marker(self.buf, marker))
        text, self.buf = self.buf[:cut], self.buf[cut:]
        return text, False

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def functions_from_tools(tools: list) -> list[Function]:
    """The functions of an OpenAI ``tools`` list, checked; ValueError names the entry."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        function = _function(tool, f"tools[{i}]")
        if any(f.name == function.name for f in functions):
            raise ValueError(f"tools[{i}].function.name {function.name!r} is given twice")
        functions.append(function)
    return functions


def _function(tool: object, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f'{where} must be an object with "type": "function"')
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}.function must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -")
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    return Function(name, parameters, description)
