"""``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio

from starlette.responses import Response

from gateway.models import ModelSet
from gateway.rest.media import MediaLoader
from gateway.rest.middleware import Call
from gateway.rest.protocol import ChatCompletionRequest, ChatMessage, ImagePart
from gateway.rest.responses import chat_logprobs
from gateway.rest.serving import CompletionRun, finish_reason
from gateway.stream import Delta, OutputStream


class ChatRenderer:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, tokenizer, logprobs: bool):
        self.tokenizer = tokenizer
        self.logprobs = logprobs

    def _logprobs(self, lps) -> dict | None:
        return chat_logprobs(self.tokenizer, lps) if self.logprobs else None

    def choice(self, prompt: int, stream: OutputStream) -> dict:
        return {
            "index": stream.index,
            "message": {"role": "assistant", "content": stream.text},
            "logprobs": self._logprobs(stream.logprobs),
            "finish_reason": finish_reason(stream),
        }

    def chunk_choice(self, prompt: int, delta: Delta, stream: OutputStream, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {}
        if delta.text:
            content["content"] = delta.text
        return {
            "index": delta.index,
            "delta": content,
            "logprobs": self._logprobs(delta.logprobs) if delta.token_ids else None,
            "finish_reason": finish_reason(stream) if delta.finish_reason else None,
        }


async def chat_completion(
    models: ModelSet, media: MediaLoader, req: ChatCompletionRequest, call: Call
) -> Response:
    """Raises InvalidRequest & co. before anything runs; failures after that are answered.
    The model that answers is the one ``models.prepare`` resolves ``req.model`` to."""
    req.check_supported()
    models.check_name(req.model or "")  # an unknown model: 404 before fetching images
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
    )
    run = CompletionRun(core, [prep], ChatRenderer(core.tokenizer, req.logprobs))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run.respond(req.stream, include_usage, call.headers)


async def resolve_messages(media: MediaLoader | None, messages: list[ChatMessage]) -> list[dict]:
    """Chat messages for the template, their image URLs loaded (placeholders when
    ``media`` is None: /tokenize counts without fetching)."""
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
        role = "system" if m.role == "developer" else m.role
        if not isinstance(m.content, list):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts = []
        for p in m.content:
            if isinstance(p, ImagePart):
                parts.append({"type": "image", "image": next(images) if media else b""})
            else:
                parts.append({"type": "text", "text": p.text})
        out.append({"role": role, "content": parts})
    return out
