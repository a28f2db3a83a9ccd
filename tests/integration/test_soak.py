"""Soak: 200 concurrent streams for 60 s through the in-process fleet (encoder, prefill,
two decodes, gateway on real NATS and Redis): no request fails, every answer equals its
undisturbed reference (greedy), and the process's resident memory stays flat.

Memory: RSS grows while the fleet warms up (about +15 % from 10 s to 30 s on the 2-core
box this was written on, then flat: +2 % from 30 s to 120 s), so two bounds: from the
warm mark (10 s, later if fewer than WARM_REQUESTS answers came by then) to the end
under RSS_GROWTH_BOUND, and over the second half of the run (a leak's slope, without the
warm-up) under RSS_SECOND_HALF_BOUND.

Part of the default run (a minute of two busy cores); ``EPD_SOAK=0`` skips it and
``EPD_SOAK_SECONDS`` shortens or lengthens it. The figures are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import grpc
import psutil
import pytest
import pytest_asyncio

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.metrics import MIGRATIONS
from tests.integration.stack import start_disaggregated

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("EPD_SOAK") == "0", reason="EPD_SOAK=0: soak skipped"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

STREAMS = 200
DURATION_S = float(os.environ.get("EPD_SOAK_SECONDS", "60"))
WARM_S = 10.0  # the first RSS mark, at the earliest ...
WARM_REQUESTS = 2 * STREAMS  # ... and not before this many answers (a slow start warms late)
RSS_GROWTH_BOUND = 0.25
RSS_SECOND_HALF_BOUND = 0.06
PROMPTS, MAX_TOKENS = 8, 24
REQUEST_S = 120.0  # one request that takes longer than this is a hang


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory, nats_server, redis_server):
    """The in-process fleet with the default heartbeat and TTL (start_disaggregated's
    ``lenient`` says why: 200 streams on one event loop delay the beats)."""
    engine = EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=2048
    )
    s = await start_disaggregated(engine, nats_server.url, redis_server.url, "soak", lenient=True)
    yield s
    await s.stop()


def request(k: int) -> pb.GenerateRequest:
    text = f"soak prompt {k}: tell me about the number {k * 7}"
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=text)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def tokens(stub, req) -> list[int]:
    got: list[int] = []
    async with asyncio.timeout(REQUEST_S):
        async for resp in stub.Generate(req):
            got += resp.token_ids
    return got


def describe(k: int, got: list[int], reference: list[list[int]]) -> str:
    """A wrong answer, told so that one failure says where to look: where it leaves its
    reference, and whether it is another prompt's answer (a crossed stream) or nobody's
    (wrong input or KV)."""
    want = reference[k]
    pairs = enumerate(zip(got, want, strict=False))
    at = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
    other = [j for j, r in enumerate(reference) if r == got]
    return (
        f"prompt {k}: {len(got)} tokens, leaves its reference at token {at} "
        f"(got {got[at : at + 4]}, want {want[at : at + 4]}); equals the answer of prompts "
        f"{other or 'none'}; tokens {got}"
    )


def moves() -> dict[str, float]:
    """The gateway's retries and migrations so far (this process), by role and kind."""
    return {
        "/".join(s.labels.values()): s.value
        for m in MIGRATIONS.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


async def test_200_streams_for_a_minute_without_errors_or_memory_growth(stack):
    assert DURATION_S > 2 * WARM_S
    reqs = [request(k) for k in range(PROMPTS)]
    reference = [await tokens(stack.stub, r) for r in reqs]
    assert all(len(r) == MAX_TOKENS for r in reference)
    done, errors, wrong = [0], [], []
    moves_before = moves()
    start = time.monotonic()
    end = start + DURATION_S

    async def client(i: int) -> None:
        k = i
        while time.monotonic() < end:
            k = (k + 1) % PROMPTS
            try:
                got = await tokens(stack.stub, reqs[k])
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                errors.append(repr(e)[:300])
                continue
            if got != reference[k]:
                wrong.append(describe(k, got, reference))
            done[0] += 1

    timeline: list[tuple[int, int]] = []  # (seconds, MiB) every 5 s, for the record

    async def sample() -> None:
        while True:
            timeline.append((round(time.monotonic() - start), rss() >> 20))
            await asyncio.sleep(5)

    clients = asyncio.gather(*(client(i) for i in range(STREAMS)))
    sampler = asyncio.create_task(sample())
    await asyncio.sleep(WARM_S)  # measuring points, not waits for anything
    # On a loaded host the first 10 s gave 241 answers instead of ~450, and the RSS
    # that then still grew counted as growth after the mark (+26 %, flat after).
    while done[0] < WARM_REQUESTS and time.monotonic() < start + DURATION_S / 4:
        await asyncio.sleep(0.5)
    warm_s, rss_warm, done_warm = time.monotonic() - start, rss(), done[0]
    await asyncio.sleep(max(0.0, start + DURATION_S / 2 - time.monotonic()))
    rss_half = rss()
    try:
        async with asyncio.timeout(DURATION_S + REQUEST_S):
            await clients
    finally:
        sampler.cancel()
    elapsed = time.monotonic() - start
    rss_end = rss()
    growth, second_half = rss_end / rss_warm - 1, rss_end / rss_half - 1
    print(
        f"\nsoak: {STREAMS} streams for {elapsed:.0f}s: {done[0]} requests "
        f"({done[0] / elapsed:.1f}/s, {done[0] * MAX_TOKENS / elapsed:.0f} tokens/s), "
        f"{done_warm} in the first {warm_s:.0f}s; errors {len(errors)}, wrong {len(wrong)}; "
        f"RSS {rss_warm / 2**20:.0f} MiB at {warm_s:.0f}s -> {rss_end / 2**20:.0f} MiB "
        f"at the end ({growth:+.1%}; second half {second_half:+.1%}); "
        f"RSS (s, MiB): {timeline}; retries and migrations {moves_before} -> {moves()}"
    )
    assert not errors, errors[:5]
    assert not wrong, wrong[:3]
    assert done[0] - done_warm >= STREAMS  # every stream kept being served after the mark
    assert growth < RSS_GROWTH_BOUND
    if DURATION_S >= 60:  # shorter runs are still warming up in their second half
        assert second_half < RSS_SECOND_HALF_BOUND
