"""Request bodies of the OpenAI-compatible API (pydantic; what /openapi.json publishes).

Unknown fields are ignored, as clients that send ``extra_body`` expect. Fields of
features this server does not have are declared so that they fail with a 400 naming
the field (``unsupported``), never a silent ignore.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.prepare import InvalidRequest
from services.structured.outputs import StructuredOutputs

_INT64 = dict(ge=-(1 << 63), le=(1 << 63) - 1)
_GUIDED = ("json", "regex", "choice", "grammar")


class Unsupported(InvalidRequest):
    """A field of a feature this server does not have."""

    def __init__(self, param: str, what: str):
        super().__init__(f"{param}: {what} is not supported by this server", param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's earlier calls, and the id of the call a tool message answers.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant's earlier thinking (sent back by some clients); the template decides.
    reasoning_content: str | None = None


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, **_INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    # vLLM's structured outputs (docs/structured-outputs.md), and its older guided_* names.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def check_supported(self) -> None:
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias")

    def constraint(self) -> tuple[StructuredOutputs | None, str]:
        """The output constraint asked for, and the field that asked (for errors)."""
        asked = {
            name: value
            for name, value in (
                ("structured_outputs", self.structured_outputs),
                *((f"guided_{k}", getattr(self, f"guided_{k}")) for k in _GUIDED),
                *self._format(),
            )
            if value is not None
        }
        if not asked:
            return None, ""
        if len(asked) > 1:
            raise InvalidRequest(f"ask for one output constraint, not {sorted(asked)}", None)
        ((param, value),) = asked.items()
        if param.startswith("guided_"):
            value = {param.removeprefix("guided_"): value}
        try:
            return StructuredOutputs.from_dict(value), param
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{param}: {e}", param) from e

    def _format(self) -> list[tuple[str, Any]]:
        return []

    def sampling_kwargs(self, max_tokens: int | None) -> dict:
        """SamplingParams keywords of the fields the client set (None: server default)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop or None,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's image processor settings per request (Qwen2.5-VL: min_pixels, max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's bound on a reasoning model's thinking, in tokens (needs --reasoning-parser).
    thinking_token_budget: int | None = Field(None, ge=0)
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions or self.function_call not in (None, "none"):
            raise Unsupported("functions", "the deprecated functions (send tools)")
        if self.modalities and set(self.modalities) != {"text"}:
            raise Unsupported("modalities", "output other than text")
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                raise Unsupported(name, name)

    def _format(self) -> list[tuple[str, Any]]:
        """``response_format`` as a structured_outputs object (None: plain text)."""
        rf = self.response_format
        if rf is None or rf.get("type") in (None, "text"):
            return []
        if rf.get("type") == "json_object":
            return [("response_format", {"json_object": True})]
        if rf.get("type") == "structural_tag":  # vLLM's: structures and triggers inline
            tag = {k: v for k, v in rf.items() if k != "type"}
            return [("response_format", {"structural_tag": tag})]
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise InvalidRequest(
                    "response_format.json_schema must be an object with a 'schema' object",
                    "response_format",
                )
            return [("response_format", {"json": spec.get("schema") or {"type": "object"}})]
        raise Unsupported("response_format", f"response_format {rf.get('type')!r}")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's legacy default.
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion)")
        if self.best_of is not None and self.best_of != self.n:
            raise Unsupported("best_of", "best_of other than n")
        if self.echo and self.logprobs is not None:
            raise Unsupported("echo", "echo with logprobs (prompt logprobs)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (a list of strings or of token-id lists is several)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # As a chat completion renders them (vLLM's /tokenize takes both).
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
