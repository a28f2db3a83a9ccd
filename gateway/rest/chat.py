"""``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio

from starlette.responses import Response

from gateway.chat_message import ChatParsers, ChatStream
from gateway.chat_output import ChatOptions, earlier_call
from gateway.models import ModelSet
from gateway.rest.media import MediaLoader
from gateway.rest.middleware import Call
from gateway.rest.protocol import ChatCompletionRequest, ChatMessage, ImagePart
from gateway.rest.responses import chat_logprobs
from gateway.rest.serving import CompletionRun, finish_reason
from gateway.stream import Delta, OutputStream


class ChatRenderer:
    """Choices of a chat completion: the answer read back by the request's parsers
    (reasoning, tool calls), whole or as deltas (one ChatStream per choice)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, tokenizer, logprobs: bool, parsers: ChatParsers):
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.parsers = parsers
        self._streams: dict[int, ChatStream] = {}

    def _logprobs(self, lps) -> dict | None:
        return chat_logprobs(self.tokenizer, lps) if self.logprobs else None

    def choice(self, prompt: int, stream: OutputStream) -> dict:
        message, called = self.parsers.message(stream.text)
        return {
            "index": stream.index,
            "message": message,
            "logprobs": self._logprobs(stream.logprobs),
            "finish_reason": _finish(stream, called and not self.parsers.named),
        }

    def chunk_choice(self, prompt: int, delta: Delta, stream: OutputStream, first: bool) -> dict:
        if delta.index not in self._streams:
            self._streams[delta.index] = self.parsers.stream()
        parts = self._streams[delta.index]
        fields = parts.feed(delta.text, last=delta.finish_reason is not None)
        content = {"role": "assistant", "content": ""} if first else {}
        return {
            "index": delta.index,
            "delta": {**content, **fields},
            "logprobs": self._logprobs(delta.logprobs) if delta.token_ids else None,
            "finish_reason": (
                _finish(stream, parts.called and not self.parsers.named)
                if delta.finish_reason
                else None
            ),
        }


def _finish(stream: OutputStream, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the answer ended calling tools (the model's choice:
    ``auto`` or ``required``)."""
    reason = finish_reason(stream)
    return "tool_calls" if called and reason == "stop" else reason


async def chat_completion(
    models: ModelSet, media: MediaLoader, req: ChatCompletionRequest, call: Call
) -> Response:
    """Raises InvalidRequest & co. before anything runs; failures after that are answered.
    The model that answers is the one ``models.prepare`` resolves ``req.model`` to."""
    req.check_supported()
    models.check_name(req.model or "")  # an unknown model: 404 before fetching images
    options = ChatOptions.of(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        req.chat_template_kwargs,
        req.thinking_token_budget,
    )
    messages = await resolve_messages(media, req.messages)
    params = req.sampling_kwargs(req.max_new_tokens)
    params["structured_outputs"], constraint_param = req.constraint()
    params["logprobs"] = req.num_logprobs
    core, prep = await models.prepare(
        model=req.model or "",
        params=params,
        messages=messages,
        request_id=call.client_id,
        tenant=call.tenant(req.user),
        cache_mode=call.cache_mode,
        session_key=call.session or req.user or "",
        constraint_param=constraint_param,
        chat=options,
        mm_processor_kwargs=req.mm_processor_kwargs,
    )
    run = CompletionRun(core, [prep], ChatRenderer(core.tokenizer, req.logprobs, prep.parsers))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run.respond(req.stream, include_usage, call.headers)


async def resolve_messages(media: MediaLoader | None, messages: list[ChatMessage]) -> list[dict]:
    """Chat messages for the template, their image URLs loaded (placeholders when
    ``media`` is None)."""
    urls = [
        p.image_url.url
        for m in messages
        if isinstance(m.content, list)
        for p in m.content
        if isinstance(p, ImagePart)
    ]
    images = iter(await asyncio.gather(*(media.load(u) for u in urls)) if media else [])
    out = []
    for m in messages:
        msg = {"role": "system" if m.role == "developer" else m.role, **_tool_fields(m)}
        if not isinstance(m.content, list):
            out.append({**msg, "content": m.content or ""})
            continue
        parts = []
        for p in m.content:
            if isinstance(p, ImagePart):
                parts.append({"type": "image", "image": next(images) if media else b""})
            else:
                parts.append({"type": "text", "text": p.text})
        out.append({**msg, "content": parts})
    return out


def _tool_fields(m: ChatMessage) -> dict:
    """A message's tool fields for the chat template."""
    out = {k: getattr(m, k) for k in ("tool_call_id", "name", "reasoning_content")}
    out = {k: v for k, v in out.items() if v is not None}
    if m.tool_calls:
        out["tool_calls"] = [
            earlier_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls
        ]
    return out
