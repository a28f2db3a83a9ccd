"""``epd bench serve`` end to end against a fake OpenAI server with known timings.

The fake server (starlette on uvicorn, in a thread, on a socket bound before it starts so no
readiness wait is needed) answers each chat request with the first token after 50 ms and
then one token every 20 ms; every fourth request gets a 429. The measured figures must sit
at those timings within scheduling noise (HTTP and event-loop work on a shared 2-core
machine: tens of ms at worst); the exact figures are proven on a simulated clock in
``tests/unit/test_bench_serve.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.bench.datasets import make_requests
from services.cli import build_parser

TTFT_S, GAP_S = 0.050, 0.020


def _sse(obj: object) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _app() -> Starlette:
    counter = itertools.count()

    async def chat(request: Request) -> Response:
        n = next(counter)
        body = await request.json()
        if n % 4 == 3:
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429)

        async def stream() -> AsyncIterator[bytes]:
            tokens = body["max_tokens"]
            for i in range(tokens):
                await asyncio.sleep(TTFT_S if i == 0 else GAP_S)
                yield _sse({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]})
            usage = {"prompt_tokens": 9, "completion_tokens": tokens}
            yield _sse({"choices": [], "usage": usage})
            yield _sse("[DONE]")

        cache = "hit-exact" if n % 2 else "miss"
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"x-epd-cache": cache})  # fmt: skip

    async def completions(request: Request) -> Response:
        """Token-id prompts only: echoes the prompt length as usage.prompt_tokens."""
        body = await request.json()
        ids = body["prompt"]
        if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            return JSONResponse({"error": {"message": "want token ids"}}, status_code=400)

        async def stream() -> AsyncIterator[bytes]:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(TTFT_S if i == 0 else GAP_S)
                yield _sse({"choices": [{"index": 0, "text": f" w{i}"}]})
            usage = {"prompt_tokens": len(ids), "completion_tokens": body["max_tokens"]}
            yield _sse({"choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])  # fmt: skip


@pytest.fixture
def fake_server() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections queue here until uvicorn starts accepting
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.mark.slow
def test_bench_serve_measures_the_fake_servers_timings(fake_server, tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", fake_server, "--model", "fake", "--num-prompts", "12",
        "--max-concurrency", "4", "--warmup", "4", "--random-input-len", "16", "--random-output-len", "6",
        "--goodput", "ttft:500", "tpot:200", "--result-json", str(out),
    ])  # fmt: skip
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert doc["schema"] == "epd-bench-serve/2"
    assert len(doc["requests"]) == 12  # the 4 warm-up requests are not measured
    assert s["errors"] == {"http_429": 3} and s["completed"] == 9
    assert s["cache"] == {"miss": 6, "hit-exact": 3}  # a 429 carries no cache header
    assert s["output_tokens"] == 9 * 6 and s["prompt_tokens"] == 9 * 9
    # Lower bounds are the server's sleeps; the upper ones allow a shared machine's stalls.
    assert 49.0 <= s["ttft_ms"]["p50"] <= 90.0, s["ttft_ms"]
    assert 19.0 <= s["tpot_ms"]["p50"] <= 30.0, s["tpot_ms"]
    assert 19.0 <= s["itl_ms"]["p50"] <= 30.0, s["itl_ms"]
    assert 149.0 <= s["e2el_ms"]["p50"] <= 220.0, s["e2el_ms"]  # 50 + 5 * 20 ms
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLOs: all meet
    table = capsys.readouterr().out
    assert "TTFT" in table and "http_429 3" in table


@pytest.mark.slow
def test_token_id_prompts_reach_completions_with_their_length(fake_server, tmp_path) -> None:
    out = tmp_path / "ids.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", fake_server, "--model", "fake", "--num-prompts", "6",
        "--max-concurrency", "3", "--random-token-ids", "--random-input-len", "40",
        "--random-range-ratio", "0.5", "--random-output-len", "4", "--result-json", str(out),
    ])  # fmt: skip
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["endpoint"] == "completions"
    s = doc["summary"]
    assert s["completed"] == 6 and s["errors"] == {}
    assert 49.0 <= s["ttft_ms"]["p50"] <= 90.0, s["ttft_ms"]
    reqs = make_requests("random", 6, 40, 4, 0.5, seed=0, token_ids=(1000, 30000))
    sent = [len(r.prompt_ids or ()) for r in reqs]
    assert [r["prompt_tokens"] for r in doc["requests"]] == sent  # the server saw every id
