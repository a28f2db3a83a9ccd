"""Chat requests beyond sampling: tools, the chat template's keywords and a reasoning
model's thinking. ``ChatOptions`` is what the request asks; ``ChatOutputs.plan`` (one
per model: it knows the tokenizer and the server's parsers) turns it into what the
engine enforces (a grammar, a thinking budget); ``ChatParsers`` reads the answer back
into ``message.reasoning`` and ``message.tool_calls`` (gateway/chat_message.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.chat_message import ChatParsers
from gateway.reasoning import opens_thinking, reasoning_parser
from gateway.request_errors import InvalidRequest
from gateway.tools import Function, functions_from_tools, tool_parser
from services.structured.outputs import StructuredOutputs

_CHOICES = ("none", "auto", "required")
# Keywords of the template call that the request may not set through chat_template_kwargs.
_RESERVED = {
    "messages",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "continue_final_message",
    "chat_template",  # a request's own template: vLLM takes one only behind a flag
}


@dataclass
class ChatOptions:
    tools: list[dict] | None = None  # as sent: the chat template renders them
    functions: list[Function] = field(default_factory=list)
    tool_choice: str = "none"  # none | auto | required | the name of one function
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_token_budget: int | None = None

    @classmethod
    def of(
        cls,
        tools: list | None,
        tool_choice: Any,
        parallel_tool_calls: bool = True,
        template_kwargs: dict | None = None,
        thinking_token_budget: int | None = None,
    ) -> ChatOptions:
        """Validated; InvalidRequest names the field. Without ``tool_choice`` a request
        with tools lets the model choose (``auto``), as OpenAI's API does."""
        try:
            functions = functions_from_tools(tools) if tools else []
        except ValueError as e:
            raise InvalidRequest(str(e), "tools") from e
        choice = _tool_choice(tool_choice, functions)
        kwargs = dict(template_kwargs or {})
        if reserved := sorted(_RESERVED & set(kwargs)):
            raise InvalidRequest(
                f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs"
            )
        return cls(
            tools or None, functions, choice, parallel_tool_calls, kwargs, thinking_token_budget
        )

    def key(self) -> str:
        """What of these changes the answer (the response cache keys by it)."""
        body = [self.tools, self.tool_choice, self.parallel_tool_calls, self.template_kwargs]
        return json.dumps([*body, self.thinking_token_budget], sort_keys=True, default=str)


def earlier_call(call_id: str, name: str, arguments: str) -> dict:
    """An assistant's earlier tool call as chat templates read it: the arguments as an
    object (templates write them with ``tojson``) when they are JSON."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_choice(value: Any, functions: list[Function]) -> str:
    if value is None:
        return "auto" if functions else "none"
    if isinstance(value, dict):
        function = value.get("function") if value.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in {f.name for f in functions}:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        return name
    if value not in _CHOICES:
        raise InvalidRequest(f"tool_choice must be one of {_CHOICES} or a function", "tool_choice")
    if value != "none" and not functions:
        raise InvalidRequest(f"tool_choice {value!r} needs tools", "tool_choice")
    return value


class ChatOutputs:
    """One model's tool-call and reasoning formats (the server's --tool-call-parser,
    --enable-auto-tool-choice and --reasoning-parser) over its tokenizer."""

    def __init__(self, tokenizer, tool_call_parser: str, auto_tool_choice: bool, reasoning: str):
        self.tokenizer = tokenizer
        self.tool_format = tool_parser(tool_call_parser) if tool_call_parser else None
        self.auto_tool_choice = auto_tool_choice
        self.reasoning = reasoning_parser(reasoning) if reasoning else None

    def plan(self, options: ChatOptions, params: dict, prompt: str) -> ChatParsers:
        """Set in ``params`` (SamplingParams keywords) what the engine must enforce for
        this request, and return what reads its answer back."""
        tools = self._tools(options, params)
        thinking = None
        if self.reasoning is not None:
            enabled = options.template_kwargs.get("enable_thinking", True) is not False
            thinking = self.reasoning(enabled=enabled, started=opens_thinking(prompt))
            if enabled:
                self._think_first(params, options.thinking_token_budget)
        elif options.thinking_token_budget is not None:
            raise InvalidRequest(
                "thinking_token_budget needs the server started with --reasoning-parser",
                "thinking_token_budget",
            )
        markers = [*(tools.markers if tools else ()), *self._reasoning_tags()]
        if any(self._special_id(m) is not None for m in markers):
            params["skip_special_tokens"] = False  # the parsers must see the markers
        named = options.tool_choice not in ("none", "auto", "required")
        return ChatParsers(tools, thinking, named)

    def _tools(self, options: ChatOptions, params: dict):
        """The tool parser of the request (None: its calls are not read), its grammar
        set as the constraint when the choice is enforced."""
        choice = options.tool_choice
        if choice == "none":
            return None
        if self.tool_format is None:
            raise InvalidRequest(
                "tool calls need the server started with --tool-call-parser", "tool_choice"
            )
        if choice == "auto" and not self.auto_tool_choice:
            raise InvalidRequest(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser (or send tool_choice "none", "required" or a function)',
                "tool_choice",
            )
        tools = self.tool_format(options.functions)
        if params.get("structured_outputs") is not None:
            if choice != "auto":
                raise InvalidRequest(
                    f"tool_choice {choice!r} cannot be combined with another output constraint",
                    "tool_choice",
                )
            return tools  # the request's own constraint wins; calls are still read
        grammar = tools.grammar(
            None if choice == "auto" else choice, options.parallel_tool_calls, self._token
        )
        params["structured_outputs"] = StructuredOutputs(grammar=_as_lark(grammar))
        return tools

    def _think_first(self, params: dict, budget: int | None) -> None:
        """A constraint applies after the thinking; the budget bounds the thinking."""
        end = self.reasoning.end
        constraint = params.get("structured_outputs")
        if constraint is not None:  # a special-token tag is matched by its id
            tag = end if self._special_id(end) is None else self._token(end)
            params["structured_outputs"] = StructuredOutputs(
                **{**vars(constraint), "reasoning_end": tag}
            )
        if budget is not None:
            params["thinking_token_budget"] = budget
            params["reasoning_end_token_ids"] = self.tokenizer.encode(end, add_special_tokens=False)

    def _reasoning_tags(self) -> tuple[str, ...]:
        return (self.reasoning.start, self.reasoning.end) if self.reasoning else ()

    def _special_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token of the tokenizer (a decode
        that skips special tokens drops it), else None."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1 or self.tokenizer.decode(ids) != text:
            return None
        return ids[0] if self.tokenizer.decode(ids, skip_special_tokens=True) == "" else None

    def _token(self, marker: str) -> str:
        """A marker in Lark: llguidance matches a special token only by its id."""
        special = self._special_id(marker)
        return json.dumps(marker) if special is None else f"<[{special}]>"


def _as_lark(grammar: str) -> str:
    """Marked as llguidance's Lark, so a ``::=`` inside an embedded schema is never read
    as GBNF (services/structured/outputs.py)."""
    return grammar if grammar.lstrip().startswith("%llguidance") else "%llguidance {}\n" + grammar
