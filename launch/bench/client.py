"""One streamed request to an OpenAI-compatible server, with the time each chunk arrived."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from launch.bench.datasets import BenchRequest

Clock = Callable[[], float]
DONE = "[DONE]"
CACHE_HEADER = "x-epd-cache"


@dataclass
class RequestRecord:
    """What a client saw of one request; times are seconds on the run's clock."""

    send_s: float
    end_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    output_tokens: int = 0  # the server's usage.completion_tokens, else tokens counted
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens where sent
    error: str | None = None  # "http_429", an exception class name, or "no_tokens"
    cache: str | None = None  # the x-epd-cache header: hit-exact | hit-semantic | miss
    kind: str | None = None  # the request's dataset kind (paraphrase), copied by ``tag``
    expect: str | None = None  # the cache outcome a right cache gives: "hit" | "miss"
    images: int = 0  # image slots sent
    image_repeats: int = 0  # of which already sent before

    @property
    def ok(self) -> bool:
        """True when the request completed with at least one token."""
        return self.error is None

    @property
    def first_token_s(self) -> float | None:
        """When the first token arrived, or None."""
        return self.chunk_s[0] if self.chunk_s else None


def tag(rec: RequestRecord, req: BenchRequest) -> RequestRecord:
    """Copy what the dataset knows of a request (kind, expected cache outcome, images)."""
    rec.kind, rec.expect = req.kind, req.expect
    rec.images, rec.image_repeats = req.images, req.image_repeats
    return rec


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A ``data:`` line's JSON object, ``DONE`` for ``[DONE]``, None for anything else."""
    if not line.startswith("data:"):
        return None  # blank separators, comments (":"), "event:" and "id:" lines
    data = line[5:].strip()
    if data == DONE:
        return DONE
    return json.loads(data) if data else None


def chunk_text(event: dict[str, Any]) -> str:
    """The generated text in one chat or completions chunk ("" for a usage-only chunk)."""
    text = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text += piece or ""
    return text


def build_payload(req: BenchRequest, model: str, endpoint: str) -> dict[str, Any]:
    """The JSON body: streamed, usage in the last chunk, exactly ``max_tokens`` wanted."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if req.prompt_ids is not None:
        if endpoint == "chat":
            raise ValueError("token-id prompts go to the completions endpoint, not chat")
        body["prompt"] = list(req.prompt_ids)
    elif endpoint == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


def _observe(rec: RequestRecord, event: dict[str, Any], now: float) -> None:
    """Fold one parsed chunk into the record."""
    if "error" in event:
        rec.error = "stream_error"  # an error object sent mid-stream after a 200
    if chunk_text(event):
        rec.chunk_s.append(now)
        rec.chunk_tokens.append(1)  # a content chunk carries one token unless usage says more
    usage = event.get("usage")
    if isinstance(usage, dict):
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    clock: Clock = time.perf_counter,
) -> RequestRecord:
    """POST ``body`` to ``url`` and stream the answer; failures become ``record.error``."""
    rec = RequestRecord(send_s=clock())
    done_s = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.cache = resp.headers.get(CACHE_HEADER)
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"http_{resp.status_code}"
            else:
                # Read to the end of the body even after [DONE]: a response left unread
                # closes its connection, and every request would then pay a new connect.
                async for line in resp.aiter_lines():
                    event = parse_sse_line(line)
                    if event == DONE:
                        done_s = clock()
                    elif isinstance(event, dict) and done_s is None:
                        _observe(rec, event, clock())
    except Exception as e:  # noqa: BLE001 - every failure is a counted kind, never a crash
        rec.error = type(e).__name__
    rec.end_s = clock() if done_s is None else done_s
    counted = sum(rec.chunk_tokens)
    rec.output_tokens = max(rec.output_tokens, counted)
    if rec.error is None and counted == 0:
        rec.error = "no_tokens"
    return rec
