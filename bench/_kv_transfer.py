"""Benchmark helper: KV transfer with ``send_chunked`` against raw NATS publish.

In this process, ``send_chunked`` to a ``ChunkReceiver`` (its own NATS connection, the
decode service's window) against raw NATS publish of the same bytes as max_payload-sized
messages to a counting subscriber, interleaved; median MB/s (MB = 1e6 bytes) per size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

KIB, MIB = 1 << 10, 1 << 20
CHUNKED_SUBJECT, RAW_SUBJECT = "bench.kv.chunked", "bench.kv.raw"


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


async def _measure_size(pub, receiver, sink: RawSink, size: int, reps: int) -> list[float]:
    """[chunked MB/s, raw MB/s] for one size: one warm-up each, then interleaved reps."""
    data = os.urandom(size)
    t_chunk, t_raw = [], []
    await chunked(pub, receiver, CHUNKED_SUBJECT, data, f"warm-{size}")
    await raw_publish(pub, sink, RAW_SUBJECT, data)
    for i in range(reps):
        pair = [
            ("c", chunked(pub, receiver, CHUNKED_SUBJECT, data, f"t{size}-{i}")),
            ("r", raw_publish(pub, sink, RAW_SUBJECT, data)),
        ]
        for kind, coro in pair if i % 2 == 0 else pair[::-1]:
            (t_chunk if kind == "c" else t_raw).append(await coro)
    return [size / 1e6 / statistics.median(t) for t in (t_chunk, t_raw)]


async def kv_transfer(
    nats_url: str, sizes: tuple[int, ...], bytes_per_size: int
) -> list[tuple[int, int, float, float]]:
    """(size, reps, chunked MB/s, raw MB/s) per size, medians of interleaved reps."""
    from services.bus.chunk_receiver import ChunkReceiver
    from services.bus.connection import Bus, BusConfig

    pub = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-kv-send"))
    recv = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-kv-recv"))
    receiver = ChunkReceiver(recv, CHUNKED_SUBJECT)  # the decode service's defaults
    sink = RawSink()
    limit = 2 * max(sizes) + MIB
    sub = await recv.client.subscribe(RAW_SUBJECT, cb=sink.on_msg, pending_bytes_limit=limit)
    out = []
    try:
        await receiver.start()
        await recv.flush()
        await asyncio.sleep(0.2)  # let the server register both subscriptions
        for size in sizes:
            reps = max(3, bytes_per_size // size)
            out.append((size, reps, *await _measure_size(pub, receiver, sink, size, reps)))
    finally:
        await sub.unsubscribe()
        await receiver.close()
        await pub.close()
        await recv.close()
    return out


async def measure_kv(nats_url: str, sizes: tuple[int, ...], bytes_per_size: int):
    """(max_payload, kv_transfer rows): the server's max_payload, probed first."""
    from services.bus.connection import Bus, BusConfig

    probe = await Bus.connect(BusConfig(servers=(nats_url,), name="bench-probe"))
    max_payload = probe.max_payload
    await probe.close()
    return max_payload, await kv_transfer(nats_url, sizes, bytes_per_size)


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
