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
import contextlib
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

from launch.bench.datasets import make_requests
from launch.cli import build_parser

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
        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"x-epd-cache": cache}
        )

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

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@contextlib.contextmanager
def _serving(app: Starlette) -> Iterator[str]:
    """``app`` on uvicorn in a thread; yields its /v1 base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections queue here until uvicorn starts accepting
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def fake_server() -> Iterator[str]:
    with _serving(_app()) as url:
        yield url


@pytest.mark.slow
def test_bench_serve_measures_the_fake_servers_timings(fake_server, tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server,
            "--model",
            "fake",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--warmup",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "6",
            "--goodput",
            "ttft:500",
            "tpot:200",
            "--result-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert doc["schema"] == "epd-bench-serve/2"
    assert len(doc["requests"]) == 12  # the 4 warm-up requests are not measured
    assert s["errors"] == {"http_429": 3} and s["completed"] == 9
    assert s["cache"] == {"miss": 6, "hit-exact": 3}  # a 429 carries no cache header
    assert s["output_tokens"] == 9 * 6 and s["prompt_tokens"] == 9 * 9
    # Lower bounds are the server's sleeps; the upper ones allow a shared machine's stalls.
    assert 49.0 <= s["ttft_ms"]["p50"] <= 150.0, s["ttft_ms"]
    assert 19.0 <= s["tpot_ms"]["p50"] <= 40.0, s["tpot_ms"]
    assert 19.0 <= s["itl_ms"]["p50"] <= 40.0, s["itl_ms"]
    assert 149.0 <= s["e2el_ms"]["p50"] <= 300.0, s["e2el_ms"]  # 50 + 5 * 20 ms
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLOs: all meet
    table = capsys.readouterr().out
    assert "TTFT" in table and "http_429 3" in table


@pytest.mark.slow
def test_token_id_prompts_reach_completions_with_their_length(fake_server, tmp_path) -> None:
    out = tmp_path / "ids.json"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server,
            "--model",
            "fake",
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--random-token-ids",
            "--random-input-len",
            "40",
            "--random-range-ratio",
            "0.5",
            "--random-output-len",
            "4",
            "--result-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["endpoint"] == "completions"
    s = doc["summary"]
    assert s["completed"] == 6 and s["errors"] == {}
    assert 49.0 <= s["ttft_ms"]["p50"] <= 150.0, s["ttft_ms"]
    reqs = make_requests("random", 6, 40, 4, 0.5, seed=0, token_ids=(1000, 30000))
    sent = [len(r.prompt_ids or ()) for r in reqs]
    assert [r["prompt_tokens"] for r in doc["requests"]] == sent  # the server saw every id


HIT_TTFT_S = 0.005  # the fake cache answers a question it has seen 5 ms after the request


class FakeCache:
    """A chat server with an exact-match answer cache and an image registry.

    A question answered before (unless the request says ``x-epd-cache: bypass``) streams
    its tokens ``HIT_TTFT_S`` after the request, back to back, as ``hit-exact``; any other
    streams at ``TTFT_S`` / ``GAP_S`` as ``miss`` and is stored when done. It counts each
    image slot whose data URL it had already received.
    """

    def __init__(self) -> None:
        self.answered: set[str] = set()
        self.images: set[str] = set()
        self.image_slots = self.image_repeats = 0
        self.connections: set[tuple[str, int]] = set()  # client (host, port) pairs seen

    async def chat(self, request: Request) -> Response:
        self.connections.add((request.client.host, request.client.port))
        body = await request.json()
        content = body["messages"][-1]["content"]
        if isinstance(content, list):
            for part in content:
                if part["type"] == "image_url":
                    url = part["image_url"]["url"]
                    self.image_slots += 1
                    self.image_repeats += url in self.images
                    self.images.add(url)
            content = " ".join(p["text"] for p in content if p["type"] == "text")
        hit = content in self.answered and request.headers.get("x-epd-cache") != "bypass"
        tokens = body["max_tokens"]

        async def stream() -> AsyncIterator[bytes]:
            for i in range(tokens):
                if hit:
                    await asyncio.sleep(HIT_TTFT_S if i == 0 else 0)
                else:
                    await asyncio.sleep(TTFT_S if i == 0 else GAP_S)
                yield _sse({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]})
            self.answered.add(content)
            yield _sse("[DONE]")

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"x-epd-cache": "hit-exact" if hit else "miss"},
        )


@pytest.fixture
def fake_cache() -> Iterator[tuple[str, FakeCache]]:
    fake = FakeCache()
    app = Starlette(routes=[Route("/v1/chat/completions", fake.chat, methods=["POST"])])
    with _serving(app) as url:
        yield url, fake


def _run(base_url: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "run.json"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--model",
            "fake",
            "--result-json",
            str(out),
            *flags,
        ]
    )
    assert args.func(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_paraphrase_hits_and_misses_with_the_cache_on_and_bypassed(fake_cache, tmp_path) -> None:
    url, fake = fake_cache
    flags = (
        "--dataset",
        "paraphrase",
        "--num-prompts",
        "20",
        "--max-concurrency",
        "1",
        "--random-output-len",
        "4",
        "--paraphrase-mix",
        "repeat:0.5,paraphrase:0.3,negative:0.2",
    )
    on = _run(url, tmp_path, *flags)["summary"]
    assert len(fake.connections) == 1  # one at a time: every request on one kept-alive connection
    exp = on["expected_cache"]
    # Exact matching: the 5 repeats hit; paraphrases are missed hits; no false hit.
    assert exp["kinds"]["repeat"]["hits"] == exp["kinds"]["repeat"]["requests"] == 5
    assert exp["kinds"]["paraphrase"] == exp["kinds"]["paraphrase"] | {"requests": 3, "hits": 0}
    assert exp["false_hits"] == 0 and exp["missed_hits"] == 3
    assert on["cache"] == {"hit-exact": 5, "miss": 15}
    # One at a time: a hit's first token 5 ms after the request on the server, a miss's 50 ms
    # (plus HTTP and a shared machine's stalls, which a run under load inflates both ways).
    hit, miss = on["by_cache"]["hit-exact"], on["by_cache"]["miss"]
    assert 4.0 <= hit["ttft_ms"]["p50"] < miss["ttft_ms"]["p50"], on["by_cache"]
    assert 49.0 <= miss["ttft_ms"]["p50"] <= 150.0, on["by_cache"]
    # Same questions bypassing the cache (the fake keeps what it stored, as a real one would).
    off = _run(url, tmp_path, *flags, "--header", "x-epd-cache:bypass")["summary"]
    assert off["cache"] == {"miss": 20} and off["expected_cache"]["missed_hits"] == 8
    assert off["by_cache"]["miss"]["e2el_ms"]["p50"] >= 49.0 + 3 * 19.0


@pytest.mark.slow
def test_random_mm_repeats_are_the_ones_the_server_saw(fake_cache, tmp_path) -> None:
    url, fake = fake_cache
    doc = _run(
        url,
        tmp_path,
        "--dataset",
        "random-mm",
        "--num-prompts",
        "12",
        "--max-concurrency",
        "3",
        "--random-output-len",
        "2",
        "--mm-images-per-request",
        "1..3",
        "--image-repeat-ratio",
        "0.5",
        "--mm-image-size",
        "32x32",
        "48x16",
    )
    img = doc["summary"]["images"]
    assert img["slots"] == sum(r["images"] for r in doc["requests"]) == fake.image_slots
    # Arrival order under concurrency may swap which copy the server sees first, never how
    # many distinct images there were: the repeats are the same count.
    assert img["repeats"] == fake.image_repeats > 0
    assert len(fake.images) == img["slots"] - img["repeats"]


@pytest.mark.slow
def test_sweep_duration_and_plots_from_the_command_line(fake_cache, tmp_path) -> None:
    url, _ = fake_cache
    doc = _run(
        url,
        tmp_path,
        "--sweep",
        "20,inf",
        "--sweep-concurrency",
        "1,2",
        "--duration",
        "0.5",
        "--random-input-len",
        "4",
        "--random-output-len",
        "3",
        "--header",
        "x-epd-cache:bypass",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert doc["schema"] == "epd-bench-serve/2"
    runs = {(r["request_rate"], r["max_concurrency"]): r["summary"] for r in doc["runs"]}
    assert list(runs) == [(20.0, 1), (20.0, 2), ("inf", 1), ("inf", 2)]
    # One request takes 50 + 2 * 20 ms = 90 ms: cap 1 back to back starts 6 in 0.5 s
    # (at 0, 90, ... 450 ms), cap 2 twice as many; stalls of a shared machine only lower it.
    assert 3 <= runs[("inf", 1)]["requests"] <= 6
    assert 6 <= runs[("inf", 2)]["requests"] <= 12
    assert all(s["failed"] == 0 and 49.0 <= s["ttft_ms"]["p50"] <= 150.0 for s in runs.values())
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["latency_vs_rate.png", "throughput_vs_concurrency.png"]
