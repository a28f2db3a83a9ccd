"""Pieces of the Lark grammars (llguidance's dialect) that make a model write tool calls
right: JSON schemas embedded with bounded whitespace, and the frame that repeats calls,
or lets free text run until a call starts and enforces the call from there."""

from __future__ import annotations

import json

from gateway.tools.base import Function

# Whitespace a model may put between JSON tokens: one space at most, so that a model
# cannot loop on whitespace, and calls read the way the formats' models write them.
WHITESPACE = {"whitespace_pattern": "[ ]?"}
TEXT = "TEXT: /(.|\\n)*/"


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def object_schema(parameters: dict) -> dict:
    """A function's arguments schema; one without "type" describes an object."""
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def json_value(schema: dict) -> str:
    """The Lark item for a JSON value matching ``schema``."""
    return "%json " + json.dumps({**schema, "x-guidance": WHITESPACE})


def chosen(
    functions: dict[str, Function], choice: str | None, parallel: bool
) -> tuple[list[Function], bool]:
    """The functions a call may name under ``choice`` (None, "required" or a name), and
    whether several calls may be made (never for a named function)."""
    if choice is None or choice == "required":
        picked = list(functions.values())
    elif choice in functions:
        picked, parallel = [functions[choice]], False
    else:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    if not picked:
        raise ValueError("no tools to call")
    return picked, parallel


def alternatives(rule: str, count: int) -> str:
    """``rule: rule_0 | rule_1 | ...``"""
    return f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(count))


def repeated(item: str, sep: str, parallel: bool) -> str:
    """One ``item``, or one or more separated by ``sep`` (a Lark fragment, may be "")."""
    if not parallel:
        return item
    return f"{item} ({sep} {item})*" if sep else f"{item}+"


def frame(
    rules: list[str], trigger: str, body: str, sep: str, choice: str | None, parallel: bool
) -> str:
    """The grammar of calls written ``trigger body`` (``trigger`` from ``token``).
    With a choice, the answer is the calls alone. Without (auto), free text runs until
    the trigger, and the call is enforced from there: a literal trigger ends a lazy
    lexeme of text (llguidance's StructTag does the same); a special token cannot occur
    in text, so it ends the text by itself. After one call (not ``parallel``) only
    whitespace may follow; in parallel, text and further calls."""
    lines = ["%llguidance {}"]
    if choice is not None:
        lines += [f"start: {repeated('call', sep, parallel)}", f"call: {trigger} {body}"]
        return "\n".join(lines + rules) + "\n"
    lines.append("start: call* TEXT" if parallel else "start: TEXT | call SPACE")
    if trigger.startswith('"'):
        lines += [f"call: trigger {body}", f"trigger[lazy]: TEXT {trigger}"]
    else:
        lines.append(f"call: TEXT {trigger} {body}")
    lines += [TEXT] + ([] if parallel else ["SPACE: /[ \\t\\r\\n]*/"])
    return "\n".join(lines + rules) + "\n"
