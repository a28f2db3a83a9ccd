"""Tool calling: the calls in a model's answer, by output format (vLLM's
``--tool-call-parser`` names), whole or streamed, and grammars that enforce them."""

from __future__ import annotations

from gateway.tools.base import (
    CallDelta,
    Function,
    StreamDelta,
    ToolCall,
    ToolParser,
    ToolStream,
    functions_from_tools,
)
from gateway.tools.hermes import HermesParser
from gateway.tools.llama3_json import Llama3JsonParser
from gateway.tools.mistral import MistralParser
from gateway.tools.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser)
}


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class for a format name; ValueError lists the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})") from None


__all__ = [
    "TOOL_PARSERS",
    "CallDelta",
    "Function",
    "StreamDelta",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "functions_from_tools",
    "tool_parser",
]
