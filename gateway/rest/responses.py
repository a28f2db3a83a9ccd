"""OpenAI response pieces shared by chat and text completions: usage, logprobs, SSE."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, StreamingResponse

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
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


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


class SSEResponse(StreamingResponse):
    """Server-sent events that end with ``data: [DONE]``; a failure after the first byte
    becomes an error event (the status line is gone by then). The body iterator is
    always closed, so a client that leaves aborts its request at once."""

    def __init__(self, events: AsyncIterator[bytes], request_id: str, headers: dict):
        super().__init__(self._framed(events, request_id), media_type="text/event-stream",
                         headers={**headers, "Cache-Control": "no-cache"})  # fmt: skip
        self._events = events  # closed too: closing the framing leaves it suspended

    @staticmethod
    async def _framed(events: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as e:
            yield sse(classify(e, request_id).openai_body())
        yield b"data: [DONE]\n\n"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
            await self._events.aclose()
