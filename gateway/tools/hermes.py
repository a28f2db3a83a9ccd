"""hermes (Qwen 2.5, Hermes): each call a JSON object in its own block,
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, text before."""

from __future__ import annotations

from collections.abc import Callable

from gateway.tools.base import ToolCall, ToolParser, ToolStream
from gateway.tools.blocks import BlockStream, parse_blocks
from gateway.tools.grammar import alternatives, chosen, frame, json_value, lit, object_schema
from gateway.tools.json_calls import CallReader, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    """Blocks of JSON calls; the arguments stream as the model writes them."""

    name = "hermes"
    markers = (OPEN, CLOSE)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_blocks(text, OPEN, CLOSE, self._block)

    def _block(self, inside: str, closed: bool) -> ToolCall | None:
        # Text after the object, inside the block, is dropped (so does the stream).
        body = inside.lstrip()
        return read_call(self, body, 0)[0] if body.startswith("{") else None

    def stream(self) -> ToolStream:
        return BlockStream(self, OPEN, CLOSE, lambda: CallReader(self))

    def grammar(self, choice: str | None, parallel: bool, token: Callable[[str], str]) -> str:
        functions, parallel = chosen(self.functions, choice, parallel)
        rules = [alternatives("call_json", len(functions))]
        for i, function in enumerate(functions):
            head = lit(f'{{"name": {lit(function.name)}, "arguments": ')
            schema = json_value(object_schema(function.parameters))
            rules.append(f"call_json_{i}: {head} {schema} {lit('}')}")
        body = f"{lit(chr(10))} call_json {lit(chr(10))} {token(CLOSE)}"
        return frame(rules, token(OPEN), body, lit("\n"), choice, parallel)
