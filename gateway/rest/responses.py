"""OpenAI response pieces shared by chat and text completions: usage, logprobs, SSE."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse

from gateway.errors import RequestFailure, classify
from gateway.prepare import PreparedRequest
from gateway.stream import OutputStream
from services.outputs import TokenLogprobs

# JSON has no -inf: a token the distribution rules out gets this logprob (as vLLM).
_MIN_LOGPROB = -9999.0


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage(preps: list[PreparedRequest], streams: list[list[OutputStream]]) -> dict:
    prompt = sum(len(p.prompt_token_ids) for p in preps)
    completion = sum(len(s.token_ids) for group in streams for s in group)
    cached = sum(max((s.num_cached_tokens for s in group), default=0) for group in streams)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def chat_logprobs(tokenizer, lps: list[TokenLogprobs | None]) -> dict:
    """``choices[i].logprobs`` of a chat completion (the tokens of this delta)."""

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    content = []
    for lp in lps:
        if lp is None:
            continue
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer, lps: list[TokenLogprobs | None], offset: int) -> dict:
    """``choices[i].logprobs`` of a text completion; ``offset``: characters before."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        if lp is None:
            continue
        text = tokenizer.decode([lp.token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp.logprob))
        out["top_logprobs"].append({tokenizer.decode([t]): _lp(v) for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def error_response(failure: RequestFailure, headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if failure.http_status in (429, 503):
        headers.setdefault("Retry-After", "1")
    return JSONResponse(failure.openai_body(), status_code=failure.http_status, headers=headers)


def sse(obj) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


class SSEResponse:
    """Server-sent events (a plain ASGI response) that end with ``data: [DONE]``.

    A failure after the first byte becomes an error event (the status line is gone by
    then). A client that leaves cancels the stream at once (a watcher task waits for
    ``http.disconnect``), and the events iterator is always closed, so the request is
    aborted on every service.
    """

    def __init__(self, events: AsyncIterator[bytes], request_id: str, headers: dict):
        self.events, self.request_id = events, request_id
        self.headers = [(k.lower().encode(), str(v).encode("latin-1")) for k, v in headers.items()]
        self.headers += [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]

    async def __call__(self, scope, receive, send) -> None:
        streamer = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streamer.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self._framed():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            streamer.uncancel()  # the client left: nothing more to send, nothing to raise
        finally:
            watcher.cancel()
            try:
                await self.events.aclose()
            except asyncio.CancelledError:
                if not gone:
                    raise
                streamer.uncancel()

    async def _framed(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.events:
                yield chunk
        except Exception as e:
            yield sse(classify(e, self.request_id).openai_body())
        yield b"data: [DONE]\n\n"
