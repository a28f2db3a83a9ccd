"""Benchmark helper: client-side TTFT / TPOT / gap2 timing of gRPC ``Generate`` streams.

Each round sends the same fresh request set to every system, alternating which goes
first; the idle system waits. Greedy outputs are compared between the first two systems.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from _latency_requests import request_set
from _stack import HOST


@dataclass
class Sample:
    kind: str
    ttft_s: float
    tpot_s: float | None
    gap2_s: float | None  # first -> second token: includes the KV hand-off when disaggregated
    tokens: tuple[int, ...]


async def timed(stub, kind: str, req) -> Sample:
    sent = time.perf_counter()
    first = last = second = None
    tokens: list[int] = []
    async for resp in stub.Generate(req):
        if resp.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += resp.token_ids
            second = second or (last if len(tokens) > 1 else None)
    if first is None:
        raise RuntimeError("the stream ended without tokens")
    tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None
    gap2 = second - first if second is not None else None
    return Sample(kind, first - sent, tpot, gap2, tuple(tokens))


async def run_level(stub, reqs, streams: int) -> list[Sample]:
    """Send ``reqs`` with ``streams`` in flight at a time; samples in request order."""
    sem = asyncio.Semaphore(streams)

    async def one(kind, req):
        async with sem:
            return await timed(stub, kind, req)

    return list(await asyncio.gather(*(one(k, r) for k, r in reqs)))


async def latency(
    ports: dict[str, int], rounds: int, warmup: int, per_level: tuple[tuple[int, int], ...]
) -> dict:
    """Warm up, then time ``rounds`` rounds; ``per_level`` is (streams, requests) pairs.

    Returns ``{"samples": {(system, streams): [Sample]}, "mismatches": int}``.
    """
    import grpc

    from protos.epd_pb import inference_pb2_grpc as pbg

    chans = {name: grpc.aio.insecure_channel(f"{HOST}:{p}") for name, p in ports.items()}
    stubs = {name: pbg.InferenceStub(ch) for name, ch in chans.items()}
    results = {(name, c): [] for name in ports for c, _ in per_level}
    mismatches = 0
    try:
        for name, stub in stubs.items():
            for c, _ in per_level:
                await run_level(stub, request_set(f"warm-{name}-{c}", warmup), c)
        names = list(ports)
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for c, n in per_level:
                reqs = request_set(f"r{r}-c{c}", n)
                got = {name: await run_level(stubs[name], reqs, c) for name in order}
                a, b = (got[name] for name in names)
                mismatches += sum(x.tokens != y.tokens for x, y in zip(a, b, strict=True))
                for name in names:
                    results[(name, c)] += got[name]
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for ch in chans.values():
            await ch.close()
    return {"samples": results, "mismatches": mismatches}
