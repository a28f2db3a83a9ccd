"""Tools, calls and the canonical text of each tool-call format, shared by the parser
and grammar tests (tests/unit/test_tool_parsers.py, test_tool_grammars.py)."""

from __future__ import annotations

import json

from gateway.tools import TOOL_PARSERS, Function, tool_parser

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
CLOCK = {  # no "type": read as an object
    "properties": {"zone": {"type": "string", "maxLength": 6}, "utc": {"type": "boolean"}},
    "required": ["zone", "utc"],
    "additionalProperties": False,
}
FUNCTIONS = [Function("get_weather", WEATHER, "Weather"), Function("get_time", CLOCK)]
SCHEMAS = {f.name: f.parameters for f in FUNCTIONS}
MARKERS = sorted({m for parser in TOOL_PARSERS.values() for m in parser.markers})

PARIS = ("get_weather", {"city": "Paris", "days": 3})
CET = ("get_time", {"zone": "CET", "utc": True})
BAD = ("get_weather", {"city": "Paris", "days": 30})


def parser(name: str):
    return tool_parser(name)(FUNCTIONS)


def write(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """The canonical text of ``calls`` in a format, as its grammar writes it."""
    dump = [(name, json.dumps(args)) for name, args in calls]
    if fmt == "hermes":
        block = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
        return "\n".join(block.format(*c) for c in dump)
    if fmt == "llama3_json":
        return "; ".join('{{"name": "{}", "parameters": {}}}'.format(*c) for c in dump)
    if fmt == "mistral":
        items = ", ".join('{{"name": "{}", "arguments": {}}}'.format(*c) for c in dump)
        return f"[TOOL_CALLS][{items}]"
    if fmt == "mistral-named":
        return "".join(f"[TOOL_CALLS]{name}[ARGS]{args}" for name, args in dump)
    blocks = []
    for name, args in calls:
        raw = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in args.items()]
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in raw)
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    return "\n".join(blocks)
