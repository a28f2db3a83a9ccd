"""``epd bench serve`` whole runs on a simulated clock: sweeps over rates and caps, --duration,
paraphrase phases, extra headers and user, plots and the result file's schema.

The run's HTTP goes through httpx's MockTransport whose stream moves a fake clock (first
token 50 ms after the request, then one every 20 ms, [DONE] 5 ms later) and arrival gaps
move the same clock, so every figure below is exact.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import httpx
import pytest
from PIL import Image

from launch.bench.load import arrival_gaps
from launch.bench.plot import plot_runs
from launch.bench.run import RunIO, bench_serve, bench_sweep
from launch.cli import build_parser

TTFT, GAP, TAIL = 0.050, 0.020, 0.005


class Sim:
    """A fake clock, a sleep that moves it, and a transport whose streams move it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.bodies: list[dict] = []
        self.models = [{"id": "served-first", "object": "model"}, {"id": "other"}]
        self.headers: list[httpx.Headers] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s

    def transport(self) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/models"):
                self.headers.append(request.headers)
                return httpx.Response(200, json={"object": "list", "data": self.models})
            body = json.loads(request.content)
            self.bodies.append(body)
            self.headers.append(request.headers)
            n = body["max_tokens"]

            async def stream() -> AsyncIterator[bytes]:
                for i in range(n):
                    self.now += TTFT if i == 0 else GAP
                    chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i}"}}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                usage = {"prompt_tokens": 3, "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                self.now += TAIL
                yield b"data: [DONE]\n\n"

            cache = "hit-exact" if body["messages"][0]["content"] in self.asked else "miss"
            self.asked.add(body["messages"][0]["content"])
            return httpx.Response(200, headers={"x-epd-cache": cache}, content=stream())

        self.asked: set[str] = set()
        return httpx.MockTransport(handler)

    def io(self) -> RunIO:
        return RunIO(transport=self.transport(), clock=self.clock, sleep=self.sleep)


def _args(*flags: str, model: tuple[str, ...] = ("--model", "m")):
    return build_parser().parse_args(
        ["bench", "serve", *model, "--no-progress", "--random-input-len", "4", *flags]
    )


async def test_without_model_the_first_served_model_is_asked() -> None:
    sim = Sim()
    flags = ("--num-prompts", "2", "--random-output-len", "2", "--api-key", "k")
    doc = await bench_serve(_args(*flags, model=()), sim.io())
    assert doc["config"]["model"] == "served-first"
    assert {b["model"] for b in sim.bodies} == {"served-first"}
    assert sim.headers[0]["authorization"] == "Bearer k"  # /v1/models sees the key too
    sim.models = []
    with pytest.raises(ValueError, match="named no model"):
        await bench_serve(_args(*flags, model=()), sim.io())


def _e2e(tokens: int) -> float:
    return TTFT + (tokens - 1) * GAP + TAIL


async def test_sweep_over_rates_and_caps_is_exact_on_the_simulated_clock() -> None:
    sim = Sim()
    args = _args(
        "--num-prompts",
        "6",
        "--random-output-len",
        "5",
        "--sweep",
        "2,inf",
        "--sweep-concurrency",
        "1,3",
        "--seed",
        "9",
    )
    doc = await bench_sweep(args, sim.io())
    assert doc["schema"] == "epd-bench-serve/2"
    runs = doc["runs"]
    assert [(r["request_rate"], r["max_concurrency"]) for r in runs] == [
        (2.0, 1),
        (2.0, 3),
        ("inf", 1),
        ("inf", 3),
    ]
    # Cap 1: requests one after another, each exactly 50 ms to the first token, 20 ms per
    # token after, 135 ms in all; the Poisson gaps (fake sleeps) are spent before the
    # first request starts, as the dispatcher does not yield to the requests while sleeping.
    gaps = sum(arrival_gaps(6, 2.0, 1.0, seed=9))
    for run, wait in ((runs[0], gaps), (runs[2], 0.0)):
        s = run["summary"]
        assert s["completed"] == 6 and len(run["requests"]) == 6
        assert s["ttft_ms"] == pytest.approx({"mean": 50, "p50": 50, "p90": 50, "p99": 50})
        assert s["tpot_ms"]["p99"] == pytest.approx(20) and s["e2el_ms"]["p50"] == pytest.approx(
            135
        )
        assert s["duration_s"] == pytest.approx(wait + 6 * _e2e(5))
        assert s["request_throughput"] == pytest.approx(6 / (wait + 6 * 0.135))
    assert runs[3]["summary"]["completed"] == 6 and runs[3]["summary"]["output_tokens"] == 30
    assert len(sim.bodies) == 4 * 6


async def test_duration_cycles_the_dataset_and_stops_starting_at_the_deadline() -> None:
    sim = Sim()
    args = _args(
        "--num-prompts",
        "3",
        "--random-output-len",
        "5",
        "--max-concurrency",
        "1",
        "--duration",
        "1.0",
    )
    doc = await bench_serve(args, sim.io())
    s = doc["summary"]
    # Starts at 0, 0.135, ... 0.945 (8 requests); the 9th would start at 1.08 > 1 s.
    assert s["requests"] == s["completed"] == 8
    assert s["duration_s"] == pytest.approx(8 * _e2e(5))
    prompts = [b["messages"][0]["content"] for b in sim.bodies]
    assert prompts[:3] == prompts[3:6] and len(set(prompts)) == 3  # the 3 prompts, cycled


async def test_duration_under_a_rate_without_a_cap_is_bounded_by_the_arrivals() -> None:
    sim = Sim()
    args = _args(
        "--num-prompts",
        "2",
        "--random-output-len",
        "1",
        "--request-rate",
        "50",
        "--duration",
        "2.0",
        "--seed",
        "3",
    )
    doc = await bench_serve(args, sim.io())
    gaps, t = arrival_gaps(1000, 50.0, 1.0, seed=3), 0.0
    started = 0
    for g in gaps:  # the dispatcher sleeps each gap, then starts unless 2 s have passed
        t += g
        if t >= 2.0:
            break
        started += 1
    assert doc["summary"]["requests"] == started and 60 <= started <= 140


async def test_paraphrase_follow_ups_start_after_every_seed_is_answered() -> None:
    sim = Sim()
    args = _args(
        "--dataset",
        "paraphrase",
        "--num-prompts",
        "20",
        "--random-output-len",
        "2",
        "--paraphrase-mix",
        "repeat:1",
        "--user",
        "run-a",
        "--header",
        "x-epd-cache:bypass",
    )
    doc = await bench_serve(args, sim.io())
    exp = doc["summary"]["expected_cache"]
    # The fake cache answers an exact repeat: every seed a miss, every repeat a hit.
    assert exp["kinds"]["seed"]["hits"] == 0 and exp["kinds"]["repeat"]["hits"] == 10
    assert exp["false_hits"] == exp["missed_hits"] == 0
    by_cache = doc["summary"]["by_cache"]  # the fake serves hits and misses at one speed
    assert {k: g["requests"] for k, g in by_cache.items()} == {"hit-exact": 10, "miss": 10}
    assert by_cache["hit-exact"]["e2el_ms"]["p50"] == pytest.approx(1000 * _e2e(2))
    reqs = doc["requests"]
    last_seed_end = max(r["end_s"] for r in reqs if r["kind"] == "seed")
    assert min(r["send_s"] for r in reqs if r["kind"] == "repeat") >= last_seed_end
    assert {b["user"] for b in sim.bodies} == {"run-a"}
    assert {h["x-epd-cache"] for h in sim.headers} == {"bypass"}


async def test_a_paraphrase_sweep_gives_each_run_its_own_cache_tenant() -> None:
    sim = Sim()
    args = _args(
        "--dataset",
        "paraphrase",
        "--num-prompts",
        "4",
        "--random-output-len",
        "1",
        "--sweep",
        "inf,inf",
        "--user",
        "t",
    )
    await bench_sweep(args, sim.io())
    assert [b["user"] for b in sim.bodies] == ["t-0"] * 4 + ["t-1"] * 4


def test_flag_combinations_that_cannot_run_are_refused() -> None:
    for flags in (
        ("--dataset", "paraphrase", "--duration", "5", "--max-concurrency", "2"),
        ("--duration", "5"),  # an infinite rate and no cap: endless burst
        ("--random-token-ids", "--endpoint", "chat"),
        ("--dataset", "random-mm", "--endpoint", "completions"),
        ("--header", "x-epd-cache"),
    ):
        with pytest.raises(SystemExit):
            asyncio.run(bench_serve(_args(*flags), Sim().io()))
    with pytest.raises(SystemExit):
        _args("--sweep", "1,0")


def test_result_json_has_no_nan_infinity_or_secret(tmp_path) -> None:
    sim = Sim()
    out = tmp_path / "r.json"
    args = _args("--num-prompts", "2", "--random-output-len", "1", "--result-json", str(out))
    doc = asyncio.run(bench_serve(args, sim.io()))
    text = json.dumps(doc, allow_nan=False)  # raises on NaN or inf
    assert doc["config"]["request_rate"] == "inf" and "Infinity" not in text
    args = _args(
        "--num-prompts",
        "1",
        "--random-output-len",
        "1",
        "--api-key",
        "k1",
        "--header",
        "Authorization: Bearer k2",
        "--header",
        "x-a:b",
    )
    doc = asyncio.run(bench_serve(args, Sim().io()))
    assert doc["config"]["header"] == ["Authorization:***", "x-a:b"]
    assert "k1" not in json.dumps(doc) and "k2" not in json.dumps(doc)


def _run(rate: float | str, cap: int | None, base: float) -> dict:
    lat = {"mean": base, "p50": base, "p90": 2 * base, "p99": 3 * base}
    return {
        "request_rate": rate,
        "max_concurrency": cap,
        "summary": {
            "ttft_ms": lat,
            "tpot_ms": lat,
            "e2el_ms": lat,
            "output_throughput": 100.0 * (cap or 1),
            "request_throughput": 1.0 * (cap or 1),
        },
    }


@pytest.mark.slow  # matplotlib's first import builds its font cache
def test_plots_are_pngs_of_the_sweep(tmp_path) -> None:
    doc = {"runs": [_run(r, c, b) for r, b in ((1.0, 10), (4.0, 20), ("inf", 40)) for c in (1, 8)]}
    paths = plot_runs(doc, tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_vs_rate.png", "throughput_vs_concurrency.png"]
    for p in paths:
        with Image.open(p) as img:
            assert img.format == "PNG" and img.size[0] >= 800
    one = {
        "config": {"request_rate": math.inf, "max_concurrency": None},
        "summary": _run("inf", None, 5)["summary"],
    }
    assert [p.name for p in plot_runs(one, tmp_path / "one")] == ["latency_vs_rate.png"]
