"""``StructuredOutputs``: what a request constrains its output to, shaped like vLLM's
``StructuredOutputsParams`` (one of ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), and its llguidance grammar."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# JSON whitespace between tokens is bounded: with free whitespace a weak (or random)
# model can emit spaces until max_tokens (vLLM's disable_any_whitespace does the same).
JSON_WHITESPACE = {"whitespace_pattern": r"[ ]?"}
MAX_SCHEMA_BYTES = 64 << 10  # a schema is compiled per request: bound its size
MAX_SCHEMA_DEPTH = 32


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. ``json``: a JSON schema (dict or its text); ``regex``;
    ``choice``: the output is one of these strings; ``grammar``: Lark, or GBNF when it
    uses ``::=`` (not when it opens with ``%llguidance``); ``json_object``: any JSON object. Validated at construction; whether
    it compiles for a tokenizer is checked by the engine when the request is added."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's structural tag (JSON text or object): free text in which each structure,
    # once the model writes one of ``triggers``, runs ``begin``, a JSON value of
    # ``schema``, ``end``.
    structural_tag: dict | str | None = None
    # The constraint applies after this text (a reasoning model's end-of-thinking tag,
    # set by the gateway's reasoning parser); before it the output is free.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "structural_tag")
        given = [k for k in kinds if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"structural_tag, json_object; got {given or 'none'}"
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be non-empty strings")
        if self.json is not None:
            _check_schema(self.json)
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _structural_tag(self.structural_tag))
        for name in ("regex", "grammar", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputs:
        """From a request's ``structured_outputs`` object (unknown keys refused)."""
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        known = {"json", "regex", "choice", "grammar", "structural_tag", "json_object"}
        known.add("reasoning_end")
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key(s) {unknown}")
        return cls(**{k: v for k, v in value.items() if v is not None})

    def key(self) -> str:
        """A stable text naming this constraint (caches key answers by it)."""
        body = {k: v for k, v in vars(self).items() if v not in (None, False)}
        return json.dumps(body, sort_keys=True, default=list)

    def check(self, tokenizer=None) -> str:
        """The grammar text, or ValueError saying why it does not compile (against
        ``tokenizer``, an ``LLTokenizer``, when given; else its syntax alone, which
        needs no model: the fleet's gateway checks that much)."""
        from llguidance import LLMatcher

        try:
            grammar = self.lark()
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(str(e)) from e
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def lark(self) -> str:
        """The llguidance grammar text (Lark with its ``%json`` / regex extensions, or
        llguidance's JSON form)."""
        body = self._body()
        return body if self.reasoning_end is None else after_text(self.reasoning_end, body)

    def _body(self) -> str:
        from llguidance import LLMatcher, grammar_from

        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_WHITESPACE)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(list(self.choice)))
        if self.structural_tag is not None:
            return _tags_grammar(self.structural_tag)
        text = self.grammar or ""
        gbnf = "::=" in text and not text.lstrip().startswith("%llguidance")
        return grammar_from("gbnf" if gbnf else "lark", text)


def after_text(end: str, body: str) -> str:
    """Free text up to the first ``end`` (a lazy lexeme: it stops there, so the grammar
    never swallows the tag), at most two newlines, then ``body``. ``end`` written
    ``<[id]>`` is one special token, which no text can hold: free text, then it."""
    grammars = json.loads(body)["grammars"] if body.lstrip().startswith("{") else None
    grammars = grammars or [{"lark_grammar": body}]
    grammars[0] = {**grammars[0], "name": "answer"}
    if re.fullmatch(r"<\[\d+\]>", end):
        thinking = f"thinking: TEXT {end}\nTEXT: /(.|\\n)*/\n"
    else:
        tag = re.escape(end).replace("/", "\\/")
        thinking = f"thinking[lazy]: /(.|\\n)*{tag}/\n"
    head = f"start: thinking SEP @answer\n{thinking}SEP: /\\n{{0,2}}/\n"
    return json.dumps({"grammars": [{"lark_grammar": head}, *grammars]})


def _structural_tag(value: dict | str) -> dict:
    """vLLM's structural tag, checked: ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``, each ``begin`` starting with a trigger."""
    value = _object(value, "structural_tag")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structured_outputs.structural_tag needs a non-empty 'structures'")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag needs 'triggers': non-empty strings")
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"structural_tag.structures[{i}] needs 'begin' and 'end' strings")
        if not isinstance(s.get("schema", {}), dict):
            raise ValueError(f"structural_tag.structures[{i}].schema must be a JSON schema object")
        _check_schema(s.get("schema", {}))
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag.structures[{i}].begin starts with no trigger")
    return {"structures": structures, "triggers": triggers}


def _tags_grammar(tag: dict) -> str:
    """Free text; from a trigger on, one of its structures (a lazy lexeme of text ending
    at the trigger: llguidance's StructTag)."""
    from llguidance import StructTag

    tags = []
    for s in tag["structures"]:
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        schema = {**(s.get("schema") or {"type": "object"}), "x-guidance": JSON_WHITESPACE}
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags, assume_special=False)


def _object(value: Any, field: str) -> dict:
    """``value`` as a JSON object (JSON text is parsed); ValueError names the field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{field} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        what = "a JSON schema object" if field == "json" else "an object"
        raise ValueError(f"structured_outputs.{field} must be {what}")
    return value


def _check_schema(schema: dict | str) -> None:
    if isinstance(schema, str) and len(schema.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"structured_outputs.json is larger than {MAX_SCHEMA_BYTES} bytes")
    schema = _object(schema, "json")
    if len(json.dumps(schema).encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"structured_outputs.json is larger than {MAX_SCHEMA_BYTES} bytes")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"structured_outputs.json is nested deeper than {MAX_SCHEMA_DEPTH}")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0
