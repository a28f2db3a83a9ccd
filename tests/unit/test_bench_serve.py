"""``epd bench serve``: SSE parsing, exact figures on a simulated clock, load shaping, CLI.

The timing tests drive the real client through httpx's MockTransport whose stream advances
a fake clock before each chunk, so TTFT, TPOT, ITL and E2E are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator

import httpx
import pytest

from launch.bench.client import DONE, RequestRecord, build_payload, parse_sse_line, send_request
from launch.bench.datasets import chat_requests, make_requests, random_requests
from launch.bench.load import arrival_gaps, run_load
from launch.bench.metrics import parse_goodput, summarize
from launch.bench.report import format_table, result_document
from launch.cli import build_parser
from services.stats import percentile

URL = "http://bench.test/v1/chat/completions"


class FakeClock:
    """A clock the fake server moves: the client reads it when each line arrives."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _chat_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def _streaming_transport(
    clock: FakeClock, tokens: int, ttft: float, gap: float, cache: str | None = "miss"
) -> httpx.MockTransport:
    """Per request: first chunk after ``ttft``, then one every ``gap``, usage, [DONE]."""

    def handler(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(tokens):
                clock.now += ttft if i == 0 else gap
                yield _sse(_chat_chunk(f"t{i}"))
            yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens}})
            clock.now += 0.005
            yield _sse(DONE)

        headers = {"content-type": "text/event-stream"} | ({"x-epd-cache": cache} if cache else {})
        return httpx.Response(200, headers=headers, content=body())

    return httpx.MockTransport(handler)


def test_parse_sse_line_reads_data_lines_only() -> None:
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line('data:{"a": 2}') == {"a": 2}
    assert parse_sse_line("data: [DONE]") == DONE
    for other in ("", ": keep-alive", "event: message", "id: 3"):
        assert parse_sse_line(other) is None


async def test_client_times_every_chunk_exactly_on_a_simulated_clock() -> None:
    clock = FakeClock()
    transport = _streaming_transport(clock, tokens=5, ttft=0.050, gap=0.020, cache="hit-exact")
    async with httpx.AsyncClient(transport=transport) as client:
        rec = await send_request(client, URL, {"stream": True}, clock=clock)
    assert rec.ok and rec.cache == "hit-exact"
    assert rec.output_tokens == 5 and rec.prompt_tokens == 7
    assert [round((t - rec.send_s) * 1000, 6) for t in rec.chunk_s] == [50, 70, 90, 110, 130]
    summary = summarize([rec], duration_s=1.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(50.0, abs=1e-9)
    assert summary["tpot_ms"]["mean"] == pytest.approx(20.0, abs=1e-9)  # (130 - 50) / 4
    assert summary["itl_ms"]["p99"] == pytest.approx(20.0, abs=1e-9)
    assert summary["e2el_ms"]["mean"] == pytest.approx(135.0, abs=1e-9)  # [DONE] at +5 ms
    assert summary["cache"] == {"hit-exact": 1}


async def test_errors_are_counted_by_kind_and_excluded_from_latency() -> None:
    clock = FakeClock()
    ok = _streaming_transport(clock, tokens=3, ttft=0.010, gap=0.010)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["n"] % 3 == 1:
            return httpx.Response(429, json={"error": {"message": "busy"}})
        if body["n"] % 3 == 2:
            raise httpx.ConnectError("refused", request=request)
        return ok.handler(request)  # type: ignore[attr-defined]

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        recs = [await send_request(client, URL, {"n": n}, clock=clock) for n in range(9)]
    summary = summarize(recs, duration_s=3.0)
    assert summary["errors"] == {"http_429": 3, "ConnectError": 3}
    assert (summary["completed"], summary["failed"]) == (3, 3 + 3)
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(10.0)


def _rec(ttft_ms: float, gaps_ms: list[float], end_extra_ms: float = 0.0) -> RequestRecord:
    first = ttft_ms / 1000
    chunks = [first]
    for g in gaps_ms:
        chunks.append(chunks[-1] + g / 1000)
    return RequestRecord(
        send_s=0.0,
        end_s=chunks[-1] + end_extra_ms / 1000,
        chunk_s=chunks,
        chunk_tokens=[1] * len(chunks),
        output_tokens=len(chunks),
    )


def test_summary_figures_and_goodput_on_synthetic_timestamps() -> None:
    recs = [_rec(10, [5, 5]), _rec(20, [10, 30]), _rec(30, [40]), _rec(40, [])]
    s = summarize(recs, duration_s=2.0, slo=parse_goodput(["ttft:25", "tpot:20"]))
    assert s["ttft_ms"] == pytest.approx({"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": 39.7})
    # TPOT per request: 5, 20, 40; the one-token request has none.
    assert s["tpot_ms"] == pytest.approx({"mean": 65 / 3, "p50": 20.0, "p90": 36.0, "p99": 39.6})
    assert sorted(percentile([5, 5, 10, 30, 40], q) for q in (0, 100)) == [5, 40]
    assert s["itl_ms"]["p50"] == pytest.approx(10.0)
    assert s["e2el_ms"]["mean"] == pytest.approx((20 + 60 + 70 + 40) / 4)
    assert s["output_tokens"] == 3 + 3 + 2 + 1
    assert s["output_throughput"] == pytest.approx(9 / 2.0)
    assert s["goodput"] == pytest.approx(2 / 2.0)  # only the first two meet ttft<=25, tpot<=20


def test_goodput_spec_is_validated() -> None:
    assert parse_goodput(["e2el:1000"]) == {"e2el": 1000.0}
    for bad in (["ttft"], ["latency:5"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_poisson_gaps_have_the_requested_mean_and_burstiness_sets_the_spread() -> None:
    poisson = arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=1)
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.03)
    # Gamma with shape k has a squared coefficient of variation of 1 / k.
    assert statistics.pvariance(poisson) / 0.25**2 == pytest.approx(1.0, rel=0.08)
    bursty = arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=1)
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.pvariance(bursty) / 0.25**2 == pytest.approx(4.0, rel=0.15)
    assert arrival_gaps(5, 4.0, 1.0, seed=7) == arrival_gaps(5, 4.0, 1.0, seed=7)
    assert arrival_gaps(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


async def test_load_waits_each_gap_and_never_exceeds_the_concurrency_cap() -> None:
    in_flight, peak, slept = 0, 0, []

    async def send(i: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        for _ in range(3):  # yield so other requests can start while this one is in flight
            await asyncio.sleep(0)
        in_flight -= 1
        return i * 10

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    gaps = [0.0, 0.5, 0.0, 0.25] + [0.0] * 16
    out = await run_load(list(range(20)), send, gaps, max_concurrency=3, sleep=fake_sleep)
    assert out == [i * 10 for i in range(20)]
    assert peak == 3
    assert slept == [0.5, 0.25]


def test_datasets_are_deterministic_and_sized() -> None:
    reqs = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert reqs == random_requests(50, 100, 20, 0.5, seed=3)
    assert all(50 <= r.prompt_words <= 150 and 10 <= r.max_tokens <= 30 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_words for r in reqs)
    fixed = make_requests("random", 4, 64, 16, 0.0, seed=0)
    assert {(r.prompt_words, r.max_tokens) for r in fixed} == {(64, 16)}
    chats = chat_requests(30, output_len=8, seed=0)
    assert chats == chat_requests(30, 8, seed=0)
    assert {len(c.messages) for c in chats} == {1, 3, 5}
    assert all(c.messages[-1]["role"] == "user" for c in chats)
    with pytest.raises(ValueError):
        make_requests("random-mm", 1, 1, 1, 0.0, 0)


def test_payload_asks_for_streamed_usage_and_exact_output_length() -> None:
    req = random_requests(1, 8, 32, 0.0, seed=0)[0]
    chat = build_payload(req, "m", "chat")
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["ignore_eos"] is True and chat["max_tokens"] == 32
    assert chat["messages"] == req.messages and "prompt" not in chat
    assert build_payload(req, "m", "completions")["prompt"] == req.prompt


def test_token_id_prompts_are_uniform_in_the_range_and_go_to_completions() -> None:
    reqs = random_requests(
        200, input_len=32, output_len=4, range_ratio=0.0, seed=5, token_ids=(1000, 1010)
    )
    assert reqs == random_requests(200, 32, 4, 0.0, seed=5, token_ids=(1000, 1010))
    ids = [i for r in reqs for i in r.prompt_ids or ()]
    assert len(ids) == 200 * 32 and set(ids) == set(range(1000, 1010))  # hi is excluded
    assert all(r.prompt_words == 32 and not r.messages for r in reqs)
    body = build_payload(reqs[0], "m", "completions")
    assert body["prompt"] == list(reqs[0].prompt_ids) and body["ignore_eos"] is True
    with pytest.raises(ValueError):
        build_payload(reqs[0], "m", "chat")
    for bad in ((10, 10), (-1, 5)):
        with pytest.raises(ValueError):
            random_requests(1, 4, 4, 0.0, seed=0, token_ids=bad)


def test_cli_registers_bench_serve_and_the_report_has_no_nan() -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--model",
            "m",
            "--request-rate",
            "2",
            "--goodput",
            "ttft:100",
            "tpot:10",
        ]
    )
    assert args.func.__name__ == "run_bench_serve"
    assert (args.dataset, args.request_rate) == ("random", 2.0)
    assert args.goodput == ["ttft:100", "tpot:10"]
    failed = RequestRecord(send_s=0.0, end_s=1.0, error="http_503")
    summary = summarize([failed], duration_s=1.0)
    doc = result_document({"model": "m"}, summary, [failed])
    assert "NaN" not in json.dumps(doc) and doc["summary"]["ttft_ms"]["p50"] is None
    assert "http_503 1" in format_table(summary)


def test_bench_imports_no_torch() -> None:
    """The benchmark runs beside the torch-free gateway: importing it must not pull torch."""
    code = (
        "import sys, launch.cli, launch.bench.cli, launch.bench.client, "
        "launch.bench.load, launch.bench.metrics, launch.bench.report, "
        "launch.bench.run, launch.bench.images, launch.bench.paraphrase, "
        "launch.bench.plot; "
        "launch.cli.build_parser(); sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
