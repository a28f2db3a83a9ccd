"""Formats that wrap each call in an open and a close tag, with text around the calls
(hermes, qwen3_coder): the block structure, whole and streamed; what is inside a block
is read by the format's reader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.tools.base import ToolCall, ToolParser, ToolStream


class BlockReader(Protocol):
    """Reads one block's inside as it arrives. ``state``: "head" (undecided), "failed"
    (not a call: ``raw`` is all the text fed) or any other (the call is committed)."""

    state: str
    raw: str

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the call's name when it becomes known, the next arguments fragment)."""
        ...

    def end(self) -> str:
        """The block closed: the last arguments fragment, if any is owed."""
        ...


def parse_blocks(
    text: str, open_tag: str, close_tag: str, read: Callable[[str, bool], ToolCall | None]
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of ``text``: ``read(inside, closed)`` makes each block a call, or
    None to keep the block as text. A block the output ends in is read unclosed."""
    content, calls, pos = [], [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        inside = start + len(open_tag)
        stop = text.find(close_tag, inside)
        end = stop + len(close_tag) if stop >= 0 else len(text)
        call = read(text[inside : stop if stop >= 0 else len(text)], stop >= 0)
        content.append(text[pos:start] if call else text[pos:end])
        calls += [call] if call else []
        pos = end
    content.append(text[pos:])
    return "".join(content).strip(), calls


class BlockStream(ToolStream):
    """Text until ``open_tag``, then the block's inside (up to ``close_tag``) to a reader;
    a block that is not a call is shown as content, tags included."""

    def __init__(
        self,
        parser: ToolParser,
        open_tag: str,
        close_tag: str,
        reader: Callable[[], BlockReader],
    ):
        super().__init__(parser)
        self._open, self._close, self._new_reader = open_tag, close_tag, reader
        self._reader: BlockReader | None = None

    def advance(self, final: bool) -> None:
        while True:
            if self._reader is None:
                text, found = self.take_until(self._open, final)
                self.text(text)
                if not found:
                    return
                self._reader = self._new_reader()
            text, found = self.take_until(self._close, final)
            self._read(text)
            if not found:
                if final:
                    self._end("")
                return
            self._end(self._close)

    def _read(self, text: str) -> None:
        reader = self._reader
        if reader.state == "failed":
            self.text(text)
            return
        name, arguments = reader.feed(text)
        if reader.state == "failed":
            self.text(self._open + reader.raw)
        else:
            self.emit(name, arguments)

    def _end(self, close: str) -> None:
        reader, self._reader = self._reader, None
        if reader.state == "head":
            self.text(self._open + reader.raw + close)
        elif reader.state == "failed":
            self.text(close)
        else:
            self.emit(None, reader.end())
            self.index += 1
