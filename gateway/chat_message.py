"""A chat answer read back: the thinking (``reasoning``, and ``reasoning_content``, its
older name), the content and the tool calls, whole (``ChatParsers.message``) or as
OpenAI's stream deltas (``ChatStream``). The reasoning parser sees the text first; the
tool parser sees what it leaves as content."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.reasoning import ReasoningParser, ReasoningStream
from gateway.tools import ToolParser, ToolStream


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(index: int | None, name: str, arguments: str) -> dict:
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


@dataclass
class ChatParsers:
    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    # tool_choice named a function: OpenAI ends such an answer with "stop".
    named: bool = False

    def message(self, text: str) -> tuple[dict, bool]:
        """``choices[i].message`` of a whole answer, and whether it called tools."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        msg: dict = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if self.tools is None or content is None:
            return msg, False
        content, calls = self.tools.parse(content)  # stripped, as the stream sends it
        msg["content"] = content or None
        if calls:
            msg["tool_calls"] = [_tool_call(None, c.name, c.arguments) for c in calls]
        return msg, bool(calls)

    def stream(self) -> ChatStream:
        return ChatStream(
            self.tools.stream() if self.tools else None,
            self.reasoning.stream() if self.reasoning else None,
        )


@dataclass
class ChatStream:
    """One choice's deltas. ``called``: a tool call has started."""

    tools: ToolStream | None
    reasoning: ReasoningStream | None
    called: bool = False

    def feed(self, text: str, last: bool) -> dict:
        """The delta fields of the next text (``last``: the choice ends with it)."""
        thinking, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if last and self.reasoning:
            more_thinking, more_content = self.reasoning.finish()
            thinking, content = thinking + more_thinking, content + more_content
        delta: dict = {}
        if thinking:
            delta["reasoning"] = delta["reasoning_content"] = thinking
        if self.tools is None:
            if content:
                delta["content"] = content
            return delta
        out = self.tools.feed(content)
        if last:
            end = self.tools.finish()
            out.content += end.content
            out.calls += end.calls
        if out.content:
            delta["content"] = out.content
        if out.calls:
            delta["tool_calls"] = [self._call(c) for c in out.calls]
            self.called = True
        return delta

    def _call(self, c) -> dict:
        if c.name is None:
            return {"index": c.index, "function": {"arguments": c.arguments}}
        return _tool_call(c.index, c.name, c.arguments)
