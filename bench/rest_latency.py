"""TTFT of the OpenAI REST API against gRPC on the same gateway, demo model.

    python bench/rest_latency.py            # about 2 minutes
    python bench/rest_latency.py --quick    # smoke run

Private NATS and Redis, the fleet (encoder, prefill, 1 decode, gateway) and a ``serve
all`` gateway, as processes on 127.0.0.1. For each system, requests alternate between
gRPC ``Generate`` and REST ``/v1/chat/completions`` (stream) one at a time, which goes
first swapping every pair; every request is new (unique text, half with a new 64x64
PNG), ``temperature=0, max_tokens=8``. TTFT = request sent -> first token on the
client: gRPC's first response with tokens, REST's first SSE chunk (read by a lean httpx
client; the official ``openai`` client is timed too, for what a user sees).
Goal: REST TTFT p50 - gRPC TTFT p50 <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _latency_requests import png  # noqa: E402
from _latency_stats import pct  # noqa: E402
from _stack import HOST, Fleet  # noqa: E402

MAX_TOKENS = 8
WORDS = "please describe what you see here in careful detail and then list every color"


def content(tag: str, image: bytes | None) -> tuple[str, bytes | None]:
    return f"request {tag}: {WORDS}.", image


async def grpc_ttft(stub, text: str, image: bytes | None) -> float:
    from protos.epd_pb import inference_pb2 as pb

    parts = ([pb.ContentPart(image=image)] if image else []) + [pb.ContentPart(text=text)]
    req = pb.GenerateRequest(
        model="demo",
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", parts=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    sent, first = time.perf_counter(), None
    async for resp in stub.Generate(req):
        if resp.token_ids and first is None:
            first = time.perf_counter()
    return first - sent


def rest_body(text: str, image: bytes | None) -> dict:
    parts = [{"type": "text", "text": text}]
    if image:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


async def rest_ttft(http, body: dict) -> float:
    payload = json.dumps(body).encode()
    sent, first = time.perf_counter(), None
    async with http.stream(
        "POST",
        "/v1/chat/completions",
        content=payload,
        headers={"Content-Type": "application/json"},
    ) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter()
    return first - sent


async def openai_ttft(client, body: dict) -> float:
    sent, first = time.perf_counter(), None
    stream = await client.chat.completions.create(**body)
    async for _ in stream:
        first = first or time.perf_counter()
    return first - sent


async def measure(grpc_port: int, http_port: int, name: str, pairs: int, warmup: int) -> dict:
    import grpc
    import httpx
    import openai

    from protos.epd_pb import inference_pb2_grpc as pbg

    out = {"grpc": [], "rest": [], "openai": []}
    async with (
        grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as ch,
        httpx.AsyncClient(base_url=f"http://{HOST}:{http_port}", timeout=60) as http,
    ):
        stub = pbg.InferenceStub(ch)
        client = openai.AsyncOpenAI(base_url=f"http://{HOST}:{http_port}/v1", api_key="-")
        for i in range(warmup + pairs):
            tag = f"{name}-{i}"
            im = png(zlib.crc32(tag.encode())) if i % 2 else None
            runs = {
                "grpc": lambda t=f"g{tag}", im=im: grpc_ttft(stub, *content(t, im)),
                "rest": lambda t=f"r{tag}", im=im: rest_ttft(http, rest_body(*content(t, im))),
                "openai": lambda t=f"o{tag}", im=im: openai_ttft(
                    client, rest_body(*content(t, im))
                ),
            }
            order = list(runs) if i % 2 == 0 else list(runs)[::-1]
            for kind in order:
                ttft = await runs[kind]()
                if i >= warmup:
                    out[kind].append(ttft * 1e3)
        await client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    pairs, warmup = (20, 4) if ap.parse_args().quick else (150, 10)
    fleet = Fleet()
    worst = float("-inf")
    try:
        fleet.start_servers()
        for role in ("encoder", "prefill", "decode"):
            fleet.spawn(role, f"{role}-0", log_level="WARNING")
        ports = {
            "disaggregated": fleet.spawn("gateway", "gateway-0", log_level="WARNING"),
            "aggregated": fleet.spawn("all", "all-0", log_level="WARNING"),
        }
        for port in ports.values():
            fleet.wait_healthy(port, timeout_s=300)
        http = {
            "disaggregated": fleet.http_ports["gateway-0"],
            "aggregated": fleet.http_ports["all-0"],
        }
        print(f"TTFT (ms), {pairs} requests per protocol, one at a time, max_tokens={MAX_TOKENS}")
        print(f"{'system':<14} {'client':<8} {'p50':>7} {'p90':>7} {'p99':>7}   REST - gRPC p50")
        for name, port in ports.items():
            res = asyncio.run(measure(port, http[name], name, pairs, warmup))
            for kind, values in res.items():
                over = pct(values, 50) - pct(res["grpc"], 50)
                note = "" if kind == "grpc" else f"   {over:+.2f} ms"
                print(
                    f"{name:<14} {kind:<8} {pct(values, 50):7.2f} {pct(values, 90):7.2f} "
                    f"{pct(values, 99):7.2f}{note}"
                )
                if kind == "rest":
                    worst = max(worst, over)
        fleet.check_alive()
    finally:
        fleet.close()
    print(
        f"\nGoal REST TTFT p50 overhead over gRPC <= 2 ms: worst {worst:+.2f} ms -> "
        f"{'met' if worst <= 2 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
