"""Disaggregated (E/P/D over NATS) against aggregated (``serve all``) on the demo model.

    python bench/disagg_latency.py            # full run, about 3 minutes
    python bench/disagg_latency.py --quick    # smoke run, about 1 minute

Everything runs on 127.0.0.1: private NATS and Redis, then as processes the fleet
(encoder, prefill, 1 decode, gateway) and one ``serve all`` gateway on another port.

- Latency: each round sends the same fresh request set to both systems, alternating which
  goes first; the idle system waits. Requests are chat prompts, half text-only and half
  with one new 64x64 PNG (so neither the embedding cache nor the prefix cache helps),
  ``temperature=0, max_tokens=32, ignore_eos``, at 1 and 4 concurrent streams. TTFT =
  request sent -> first response with tokens; TPOT = (last - first token time) / (n - 1),
  both on the client; gap2 = first -> second token (the KV hand-off when disaggregated).
  Goal: TTFT p50 overhead (disaggregated - aggregated) <= 10 ms.
- KV transfer: in this process, ``send_chunked`` to a ``ChunkReceiver`` (its own NATS
  connection, the decode service's window) against raw NATS publish of the same bytes as
  max_payload-sized messages to a counting subscriber, interleaved; median MB/s
  (MB = 1e6 bytes) per size. Goal: chunked >= 50 % of raw.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from _stack import HOST, Fleet  # noqa: E402

MAX_TOKENS = 32
KIB, MIB = 1 << 10, 1 << 20


@dataclass
class Sizes:
    """Workload sizes; ``--quick`` shrinks all of them."""

    rounds: int = 20
    warmup: int = 6  # requests per system and concurrency level before timing
    per_level: tuple[tuple[int, int], ...] = ((1, 8), (4, 16))  # (streams, requests) per round
    kv_sizes: tuple[int, ...] = (64 * KIB, 1 * MIB, 8 * MIB, 32 * MIB)
    kv_bytes_per_size: int = 256 * MIB  # bytes moved per size and method (>= 3 reps)


QUICK = Sizes(rounds=2, warmup=2, per_level=((1, 4), (4, 8)), kv_bytes_per_size=32 * MIB)


# ------------------------------------------------------------------- requests


def png(seed: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (64, 64), rng.randbytes(64 * 64 * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def request(tag: str, image: bytes | None):
    from protos.epd_pb import inference_pb2 as pb

    words = "please describe what you see here in careful detail and then list every color"
    text = f"request {tag}: {words}, {words}."
    parts = ([pb.ContentPart(image=image)] if image else []) + [pb.ContentPart(text=text)]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(model="demo", sampling=sp,
                              chat=pb.Chat(messages=[pb.ChatMessage(role="user", parts=parts)]))  # fmt: skip


def request_set(round_id: str, n: int) -> list[tuple[str, object]]:
    """(kind, request) pairs, alternating text and 1-image; unique per round."""
    out = []
    for i in range(n):
        kind = "image" if i % 2 else "text"
        image = png(zlib.crc32(f"{round_id}-{i}".encode())) if kind == "image" else None
        out.append((kind, request(f"{round_id}-{i}", image)))
    return out


# ------------------------------------------------------------------- latency


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


async def latency(ports: dict[str, int], s: Sizes) -> dict:
    import grpc

    from protos.epd_pb import inference_pb2_grpc as pbg

    chans = {name: grpc.aio.insecure_channel(f"{HOST}:{p}") for name, p in ports.items()}
    stubs = {name: pbg.InferenceStub(ch) for name, ch in chans.items()}
    results = {(name, c): [] for name in ports for c, _ in s.per_level}
    mismatches = 0
    try:
        for name, stub in stubs.items():
            for c, _ in s.per_level:
                await run_level(stub, request_set(f"warm-{name}-{c}", s.warmup), c)
        names = list(ports)
        for r in range(s.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for c, n in s.per_level:
                reqs = request_set(f"r{r}-c{c}", n)
                got = {name: await run_level(stubs[name], reqs, c) for name in order}
                a, b = (got[name] for name in names)
                mismatches += sum(x.tokens != y.tokens for x, y in zip(a, b, strict=True))
                for name in names:
                    results[(name, c)] += got[name]
            print(f"  round {r + 1}/{s.rounds} done", file=sys.stderr, flush=True)
    finally:
        for ch in chans.values():
            await ch.close()
    return {"samples": results, "mismatches": mismatches}


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (q in 0..100)."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def report_latency(res: dict, s: Sizes) -> float:
    """Print the tables; return the TTFT p50 overhead (ms) at 1 stream, all prompts."""
    samples = res["samples"]
    print(f"\nLatency (ms), {s.rounds} rounds, max_tokens={MAX_TOKENS}, ignore_eos")
    print(f"{'streams':>7} {'prompts':>7} {'n':>4} | {'system':<7} {'TTFT p50':>9} {'TTFT p99':>9}"
          f" {'TPOT p50':>9} {'TPOT p99':>9} {'gap2 p50':>9} {'gap2 p99':>9}")  # fmt: skip
    overhead_c1 = float("nan")
    for c, _ in s.per_level:
        for kind in ("text", "image", "all"):
            p50s = {}
            for name in ("disagg", "agg"):
                sel = [x for x in samples[(name, c)] if kind in ("all", x.kind)]
                ttft = [x.ttft_s * 1e3 for x in sel]
                tpot = [x.tpot_s * 1e3 for x in sel if x.tpot_s is not None]
                gap2 = [x.gap2_s * 1e3 for x in sel if x.gap2_s is not None]
                p50s[name] = pct(ttft, 50)
                print(f"{c:>7} {kind:>7} {len(sel):>4} | {name:<7} {pct(ttft, 50):9.1f} "
                      f"{pct(ttft, 99):9.1f} {pct(tpot, 50):9.2f} {pct(tpot, 99):9.2f} "
                      f"{pct(gap2, 50):9.1f} {pct(gap2, 99):9.1f}")  # fmt: skip
            over = p50s["disagg"] - p50s["agg"]
            print(
                f"{'':>20}   TTFT p50 overhead {over:+.1f} ms ({p50s['disagg'] / p50s['agg']:.2f}x)"
            )
            if c == 1 and kind == "all":
                overhead_c1 = over
    print(f"greedy outputs that differ between the systems: {res['mismatches']}")
    return overhead_c1


# ------------------------------------------------------------------- KV transfer


class RawSink:
    """A subscriber that counts bytes; subscribed once, before any timing, because the
    server may report no interest for a few ms after a SUB (see BusConfig)."""

    def __init__(self) -> None:
        self.got, self.target = 0, 0
        self.done = asyncio.Event()

    async def on_msg(self, msg) -> None:
        self.got += len(msg.data)
        if self.got >= self.target:
            self.done.set()

    def expect(self, nbytes: int) -> None:
        self.got, self.target = 0, nbytes
        self.done.clear()


async def raw_publish(pub, sink: RawSink, subject: str, data: bytes) -> float:
    """Seconds to publish ``data`` as max_payload-sized messages until all arrived."""
    step = pub.client.max_payload
    sink.expect(len(data))
    view = memoryview(data)
    t0 = time.perf_counter()
    for off in range(0, len(data), step):
        await pub.client.publish(subject, bytes(view[off : off + step]))
    await asyncio.wait_for(sink.done.wait(), timeout=60)
    return time.perf_counter() - t0


async def chunked(pub, receiver, subject: str, data: bytes, tid: str) -> float:
    """Seconds for one send_chunked (until the receiver verified it) and the claim."""
    from services.bus.chunked import send_chunked

    t0 = time.perf_counter()
    await send_chunked(pub, subject, b"kv-header", data, timeout_s=30, transfer_id=tid)
    await receiver.receive(tid, timeout_s=30)
    return time.perf_counter() - t0


async def kv_transfer(nats_url: str, s: Sizes) -> list[tuple[int, int, float, float]]:
    """(size, reps, chunked MB/s, raw MB/s) per size, medians of interleaved reps."""
    from services.bus.chunk_receiver import ChunkReceiver
    from services.bus.connection import Bus, BusConfig

    pub = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-kv-send"))
    recv = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-kv-recv"))
    receiver = ChunkReceiver(recv, "bench.kv.chunked")  # the decode service's defaults
    sink = RawSink()
    limit = 2 * max(s.kv_sizes) + MIB
    sub = await recv.client.subscribe("bench.kv.raw", cb=sink.on_msg, pending_bytes_limit=limit)
    out = []
    try:
        await receiver.start()
        await recv.flush()
        await asyncio.sleep(0.2)  # let the server register both subscriptions
        for size in s.kv_sizes:
            data = os.urandom(size)
            reps = max(3, s.kv_bytes_per_size // size)
            t_chunk, t_raw = [], []
            await chunked(pub, receiver, "bench.kv.chunked", data, f"warm-{size}")
            await raw_publish(pub, sink, "bench.kv.raw", data)
            for i in range(reps):
                pair = [("c", chunked(pub, receiver, "bench.kv.chunked", data, f"t{size}-{i}")),
                        ("r", raw_publish(pub, sink, "bench.kv.raw", data))]  # fmt: skip
                for kind, coro in pair if i % 2 == 0 else pair[::-1]:
                    (t_chunk if kind == "c" else t_raw).append(await coro)
            mbps = [size / 1e6 / statistics.median(t) for t in (t_chunk, t_raw)]
            out.append((size, reps, *mbps))
    finally:
        await sub.unsubscribe()
        await receiver.close()
        await pub.close()
        await recv.close()
    return out


def report_kv(rows, max_payload: int) -> float:
    """Print the table; return the worst chunked/raw ratio."""
    print(f"\nKV transfer over NATS (max_payload {max_payload} B), median of interleaved reps")
    print(f"{'size':>8} {'reps':>5} | {'chunked MB/s':>12} {'raw MB/s':>9} {'ratio':>6}")
    worst = float("inf")
    for size, reps, c, r in rows:
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        print(f"{label:>8} {reps:>5} | {c:12.1f} {r:9.1f} {c / r:6.0%}")
        worst = min(worst, c / r)
    return worst


# ------------------------------------------------------------------- main


def demo_kv_line() -> str:
    from services.config import EngineConfig
    from services.models.info import ModelInfo

    tc = ModelInfo.load(EngineConfig(model="demo")).text_config
    heads = tc.num_key_value_heads
    per_token = 2 * tc.num_hidden_layers * heads * (tc.hidden_size // tc.num_attention_heads) * 4
    return (f"demo KV (fp32 on CPU): {per_token} B/token, {per_token * 16 // KIB} KiB per "
            f"16-token block; a 64-token prompt {per_token * 64 // KIB} KiB, the full "
            f"{tc.max_position_embeddings}-token context {per_token * tc.max_position_embeddings // MIB} MiB")  # fmt: skip


def start_systems(fleet: Fleet) -> dict[str, int]:
    fleet.start_servers()
    for role in ("encoder", "prefill", "decode"):
        fleet.spawn(role, f"{role}-0")
    ports = {"disagg": fleet.spawn("gateway", "gateway-0"), "agg": fleet.spawn("all", "all-0")}
    t0 = time.perf_counter()
    for port in ports.values():
        fleet.wait_healthy(port, timeout_s=300)
    print(f"stack healthy after {time.perf_counter() - t0:.1f}s (logs in {fleet.logdir})")
    return ports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer rounds and bytes")
    s = QUICK if ap.parse_args().quick else Sizes()
    started = time.perf_counter()
    print(demo_kv_line())  # also generates the demo checkpoint once, before the children
    fleet = Fleet()
    try:
        ports = start_systems(fleet)
        overhead = report_latency(asyncio.run(latency(ports, s)), s)
        fleet.check_alive()
        max_payload, rows = asyncio.run(_kv(fleet.nats.url, s))
        worst = report_kv(rows, max_payload)
    finally:
        fleet.close()
    print(
        f"\nGoal TTFT p50 overhead <= 10 ms (1 stream, all prompts): {overhead:+.1f} ms -> "
        f"{'met' if overhead <= 10 else 'MISSED'}"
    )
    print(
        f"Goal KV chunked >= 50 % of raw NATS publish: worst {worst:.0%} -> "
        f"{'met' if worst >= 0.5 else 'MISSED'}"
    )
    print(f"total {time.perf_counter() - started:.0f}s")
    return 0


async def _kv(nats_url: str, s: Sizes):
    from services.bus.connection import Bus, BusConfig

    probe = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-probe"))
    max_payload = probe.max_payload
    await probe.close()
    return max_payload, await kv_transfer(nats_url, s)


if __name__ == "__main__":
    sys.exit(main())
