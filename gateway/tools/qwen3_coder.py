"""qwen3_coder (Qwen3-Coder, Nemotron 3 Super): XML-style calls whose values are raw
text, typed by the function's schema::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.tools.base import Function, ToolCall, ToolParser, ToolStream
from gateway.tools.blocks import BlockStream, parse_blocks
from gateway.tools.grammar import alternatives, chosen, frame, json_value, lit, object_schema
from gateway.tools.json_calls import loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3CoderParser(ToolParser):
    """Blocks of one function each; a parameter's value is sent once it closes."""

    name = "qwen3_coder"
    markers = (OPEN, CLOSE, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_blocks(text, OPEN, CLOSE, self._block)

    def _block(self, inside: str, closed: bool) -> ToolCall | None:
        # The stream's reader decides, so that both read a block alike; a closed block
        # may lack </function> (the parameters read so far are the call).
        reader = _FunctionReader(self)
        name, arguments = reader.feed(inside)
        arguments += reader.end() if closed else ""
        if reader.state != "done":
            return None
        return ToolCall(name, json.dumps(json.loads(arguments), ensure_ascii=False))

    def stream(self) -> ToolStream:
        return BlockStream(self, OPEN, CLOSE, lambda: _FunctionReader(self))

    def grammar(self, choice: str | None, parallel: bool, token: Callable[[str], str]) -> str:
        functions, parallel = chosen(self.functions, choice, parallel)
        rules = [alternatives("function", len(functions))]
        for i, function in enumerate(functions):
            rules += _function_rules(f"function_{i}", function, token)
        body = f"{lit(chr(10))} function {token(CLOSE)}"
        return frame(rules, token(OPEN), body, lit("\n"), choice, parallel)


def convert(raw: str, schema: object) -> object:
    """A parameter's value from its text: a "string" stays text (less the newline after
    the tag and the one before the closing tag); any other type, or none, is read as
    JSON (``True`` / ``False`` too, for a boolean), else kept as text."""
    text = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    if kind == "boolean" and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        return loads(text)
    except ValueError:
        return text


def next_item(text: str) -> tuple[str, str, str, int] | None:
    """The next thing in a function's body: ("param", name, raw value, end) or
    ("end", "", "", end) at </function>; None while ``text`` holds neither whole."""
    param, stop = text.find(PARAMETER), text.find(FUNCTION_END)
    if stop >= 0 and (param < 0 or stop < param):
        return "end", "", "", stop + len(FUNCTION_END)
    if param < 0:
        return None
    close = text.find(">", param)
    value_end = text.find(PARAMETER_END, close) if close >= 0 else -1
    if value_end < 0:
        return None
    key = text[param + len(PARAMETER) : close]
    return "param", key, text[close + 1 : value_end], value_end + len(PARAMETER_END)


class _FunctionReader:
    """One block's inside as it arrives: ``<function=NAME>`` commits the call (state
    body), then each parameter, once closed, adds ``{"key": value`` or ``, "key": value``
    to the arguments, and </function> the closing brace (state done)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.raw = ""
        self.state = "head"
        self._buf = ""
        self._function: Function | None = None
        self._count = 0  # parameters sent

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the function's name when it becomes known, the next arguments fragment)."""
        self.raw += text
        if self.state not in ("head", "body"):
            return None, ""
        self._buf += text
        name = self._head() if self.state == "head" else None
        return name, self._body() if self.state == "body" else ""

    def end(self) -> str:
        """The closing brace, if </function> did not send it."""
        if self.state != "body":
            return ""
        self.state = "done"
        return "}" if self._count else "{}"

    def _head(self) -> str | None:
        head = self._buf.lstrip()
        if not head.startswith(FUNCTION):
            self.state = "head" if FUNCTION.startswith(head) else "failed"
            return None
        close = head.find(">", len(FUNCTION))
        if close < 0:
            return None
        name = head[len(FUNCTION) : close]
        if name not in self.parser.functions:
            self.state = "failed"
            return None
        self._function, self.state = self.parser.functions[name], "body"
        self._buf = head[close + 1 :]
        return name

    def _body(self) -> str:
        out = []
        while self.state == "body" and (item := next_item(self._buf)):
            kind, key, value, end = item
            self._buf = self._buf[end:]
            if kind == "end":
                out.append(self.end())
                continue
            properties = self._function.parameters.get("properties")
            schema = properties.get(key) if isinstance(properties, dict) else None
            value = json.dumps(convert(value, schema), ensure_ascii=False)
            key = json.dumps(key, ensure_ascii=False)
            out.append(f"{', ' if self._count else '{'}{key}: {value}")
            self._count += 1
        return "".join(out)


def _function_rules(rule: str, function: Function, token: Callable[[str], str]) -> list[str]:
    """``rule``: one call of ``function``; its parameters in the schema's order, the
    required ones mandatory. Without properties, any parameters (unless forbidden)."""
    schema = object_schema(function.parameters)
    properties = schema.get("properties")
    head = f"{rule}: {token(FUNCTION)} {lit(function.name + '>' + chr(10))}"
    end = f"{token(FUNCTION_END)} {lit(chr(10))}"
    if not isinstance(properties, dict) or not properties:
        if schema.get("additionalProperties") is False:
            return [f"{head} {end}"]
        key = "/[a-zA-Z0-9_.-]{1,64}/"
        value = _text_rule(f"{rule}_any_value", {}, token)
        item = f"{rule}_any: {token(PARAMETER)} {key} {lit('>' + chr(10))} {rule}_any_value"
        return [f"{head} {rule}_any* {end}", f"{item} {lit(chr(10))}", value]
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items, rules = [], []
    for j, (key, prop) in enumerate(properties.items()):
        name = f"{rule}_{j}"
        opener = f"{token(PARAMETER)} {lit(key + '>' + chr(10))}"
        rules += [f"{name}: {opener} {name}_value {lit(chr(10))}"]
        rules += [_value_rule(f"{name}_value", prop, defs, token)]
        items.append(name if key in required else f"{name}?")
    return [f"{head} {' '.join(items)} {end}"] + rules


def _value_rule(rule: str, prop: object, defs: dict, token: Callable[[str], str]) -> str:
    """A parameter's value and the end of its tag: text for a string (one of its enum
    values, when given), else JSON of the property's schema."""
    prop = prop if isinstance(prop, dict) else {}
    close = f"{lit(chr(10))} {token(PARAMETER_END)}"
    if prop.get("type") != "string":
        return f"{rule}: {json_value({**prop, **defs})} {close}"
    options = prop.get("enum", [prop["const"]] if "const" in prop else None)
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return f"{rule}: ({' | '.join(lit(o) for o in options)}) {close}"
    return _text_rule(rule, prop, token)


def _text_rule(rule: str, prop: dict, token: Callable[[str], str]) -> str:
    """Free text (within min/maxLength) up to the closing tag. A literal tag ends a lazy
    lexeme at its first occurrence; a special token cannot occur in text, so the text,
    ending in the newline before it, is greedy."""
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    low = low if isinstance(low, int) else 0
    count = f"{{{low},{high}}}" if isinstance(high, int) else f"{{{low},}}"
    close = token(PARAMETER_END)
    if close.startswith('"'):
        return f"{rule}[lazy]: /(?s:.){count}/ {lit(chr(10))} {close}"
    return f"{rule}: /(?s:.){count}\\n/ {close}"
