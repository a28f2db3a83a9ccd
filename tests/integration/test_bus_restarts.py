"""NATS and Redis restarted in the middle of load: nothing hangs, nothing is wrong.

Each test runs its own server of the restarted kind on a fixed port (so the new process
comes back where the clients reconnect to) and an in-process fleet on it. Every stream
either completes with the tokens of the same request run undisturbed (greedy) or fails
with UNAVAILABLE; every wait is bounded; after the restart new requests succeed. The
split between the two outcomes depends on timing and is printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import collections
import io
import time

import grpc
import pytest

from decode_svc.service import DecodeService
from launch.localstack import ServerProcess, free_port, start_nats, start_redis
from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from services.metrics import MIGRATIONS
from tests.helpers.checkpoints import make_text_checkpoint, random_image
from tests.integration.stack import service_config, start_disaggregated, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

STREAMS = 20
# Bounds every wait: a request that neither finishes nor fails within it is a hang.
WAIT_S = 120.0


def text_request(i: int, max_tokens: int) -> pb.GenerateRequest:
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=f"stream {i}: keep talking")])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


def image_request(i: int, max_tokens: int) -> pb.GenerateRequest:
    buf = io.BytesIO()
    random_image(700 + i, (48, 40)).save(buf, format="PNG")
    parts = [pb.ContentPart(image=buf.getvalue()), pb.ContentPart(text=f"picture {i}?")]
    msg = pb.ChatMessage(role="user", parts=parts)
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def run(stub, req, got: list[int]) -> list[int] | str:
    """The stream's tokens, or the name of the status it failed with."""
    try:
        async for resp in stub.Generate(req, timeout=WAIT_S):
            got += resp.token_ids
        return got
    except grpc.aio.AioRpcError as e:
        return e.code().name


def tally(outcomes, reference) -> collections.Counter:
    """'ok' (tokens equal the reference), a status name, or 'WRONG TOKENS'."""
    counts = collections.Counter()
    for out, ref in zip(outcomes, reference, strict=True):
        counts["ok" if out == ref else out if isinstance(out, str) else "WRONG TOKENS"] += 1
    return counts


async def restart(server: ServerProcess, start, down_s: float = 0.0) -> ServerProcess:
    """Stop ``server``, leave it down ``down_s`` (the outage being simulated, not a wait
    for anything) and start a new one on its port; off the event loop, so the
    in-process services keep running meanwhile."""
    await asyncio.to_thread(server.stop)
    await asyncio.sleep(down_s)
    return await asyncio.to_thread(start, server.port)


def moves() -> dict[str, float]:
    """The gateway's retries and migrations so far, by role and kind."""
    return {
        f"{s.labels['role']}/{s.labels['kind']}": s.value
        for s in MIGRATIONS.collect()[0].samples
        if s.name.endswith("_total")
    }


async def load_with_restart(stub, reqs, reference, ready, do_restart):
    """Run every request as a stream; ``do_restart()`` once ``ready(tokens so far of
    each stream)``. Returns the tally, the tokens each stream had when the restart
    began, and how many streams were done then."""
    got: list[list[int]] = [[] for _ in reqs]
    tasks = [asyncio.create_task(run(stub, r, g)) for r, g in zip(reqs, got, strict=True)]
    async with asyncio.timeout(WAIT_S):
        while not ready(got):
            await asyncio.sleep(0.005)
    at_restart = [len(g) for g in got]
    done_at_restart = sum(t.done() for t in tasks)
    before = moves()
    await do_restart()
    async with asyncio.timeout(WAIT_S):  # nothing hangs
        outcomes = await asyncio.gather(*tasks)
    after = moves()
    moved = {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}
    print(
        f"tokens per stream at the restart: {at_restart}; done then: {done_at_restart}; "
        f"requests moved: {moved}"
    )
    return tally(outcomes, reference), at_restart, done_at_restart


# ------------------------------------------------------------------------------ NATS


@pytest.mark.parametrize("down_s", [0.0, 2.0], ids=["bounce", "outage-past-instance-ttl"])
async def test_nats_restart_mid_streams_completes_or_fails_cleanly(tmp_path, redis_server, down_s):
    """``down_s`` 2: longer than the instance TTL (1 s), so the gateway loses sight of
    every worker while the server is away."""
    nats = await asyncio.to_thread(start_nats, free_port())
    ckpt = make_text_checkpoint(tmp_path, "llama", max_position_embeddings=2048)
    engine = EngineConfig(model=str(ckpt), num_kv_blocks=2048)

    def cfg(name: str):
        return service_config(nats.url, redis_server.url, f"{name}-nr")

    services = [
        PrefillService(engine, cfg("prefill")),
        DecodeService(engine, cfg("decode0")),
        DecodeService(engine, cfg("decode1")),
    ]
    gw = channel = None
    try:
        await asyncio.gather(*(s.start() for s in services))
        gw = await start_gateway(engine, cfg("gateway"), aggregated=False)
        registry = gw.core.backend.registry
        backend = gw.core.backend
        await registry.wait_for(
            lambda: backend.ready() and len(backend.router.live("decode")) == 2, 30
        )
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        stub = pbg.InferenceStub(channel)
        reqs = [text_request(i, max_tokens=400) for i in range(STREAMS)]
        reference = await asyncio.gather(*(run(stub, r, []) for r in reqs))
        assert all(isinstance(r, list) and len(r) == 400 for r in reference), reference

        async def bounce() -> None:
            nonlocal nats
            nats = await restart(nats, start_nats, down_s)

        def mid_stream(got) -> bool:
            return all(len(g) >= 20 for g in got)

        counts, _, done_at_restart = await load_with_restart(
            stub, reqs, reference, mid_stream, bounce
        )
        print(f"NATS restart mid-stream (down {down_s}s): {dict(counts)}")
        assert set(counts) <= {"ok", "UNAVAILABLE"}, counts
        assert done_at_restart < STREAMS  # not vacuous: the restart hit live streams
        # After the restart: the fleet is back, new requests are served. Back means a
        # heartbeat from every worker since now: after an outage of the whole fleet the
        # registry keeps the instances it last heard for a while (it takes the silence
        # for a stall of its own), and a worker beats on the new server only once it has
        # reconnected, with its subscriptions resent ahead of the beat.
        since = time.monotonic()

        def all_heard_again() -> bool:
            infos = [i for role in ("prefill", "decode") for i in registry.live(role)]
            return len(infos) == 3 and all(i.last_seen > since for i in infos)

        await registry.wait_for(all_heard_again, WAIT_S)
        after = [text_request(100 + i, max_tokens=16) for i in range(4)]
        outs = await asyncio.gather(*(run(stub, r, []) for r in after))
        assert all(isinstance(o, list) and len(o) == 16 for o in outs), outs
    finally:
        if channel is not None:
            await channel.close()
        if gw is not None:
            await gw.stop()
        await asyncio.gather(*(s.stop() for s in services))
        await asyncio.to_thread(nats.stop)


# ----------------------------------------------------------------------------- Redis


async def test_redis_restart_mid_load_completes_or_fails_cleanly(tmp_path, nats_server):
    """Image requests (their embeddings go through Redis) and text ones; Redis comes
    back empty, so embeddings written before the restart are gone after it."""
    redis = await asyncio.to_thread(start_redis, free_port())
    engine = EngineConfig(model="demo", demo_dir=str(tmp_path / "demo"), num_kv_blocks=1024)
    stack = await start_disaggregated(engine, nats_server.url, redis.url, "rr", num_decode=1)
    try:
        reqs = [
            (image_request if i % 2 else text_request)(i, max_tokens=120) for i in range(STREAMS)
        ]
        reference = await asyncio.gather(*(run(stack.stub, r, []) for r in reqs))
        assert all(isinstance(r, list) and len(r) == 120 for r in reference), reference
        await asyncio.to_thread(_flush, redis)  # the load encodes every image again

        async def bounce() -> None:
            nonlocal redis
            redis = await restart(redis, start_redis)

        def first_token(got) -> bool:
            return any(got)

        counts, at_restart, _ = await load_with_restart(
            stack.stub, reqs, reference, first_token, bounce
        )
        print(f"Redis restart mid-load: {dict(counts)}")
        assert set(counts) <= {"ok", "UNAVAILABLE"}, counts
        # Not vacuous: image requests were still before their first token (encode or
        # prefill still ahead of them) when Redis went away.
        assert any(n == 0 for i, n in enumerate(at_restart) if i % 2), at_restart
        after = [image_request(100 + i, max_tokens=16) for i in range(4)]
        after += [image_request(i, max_tokens=120) for i in range(1, 5, 2)]  # known images
        outs = await asyncio.gather(*(run(stack.stub, r, []) for r in after))
        assert all(isinstance(o, list) for o in outs), outs
        assert outs[4:] == [reference[1], reference[3]]
    finally:
        await stack.stop()
        await asyncio.to_thread(redis.stop)


def _flush(server: ServerProcess) -> None:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(server.url)
    try:
        client.flushdb()
    finally:
        client.close()


async def test_an_embedding_lost_before_prefill_reads_it_is_encoded_again(
    tmp_path, nats_server, redis_server
):
    """What a Redis restart (or eviction, or a failover to a replica without the write) does
    to a request between encode and prefill, made deterministic: the prefill instance reads
    a Redis that never holds what the encoder wrote there."""
    from encoder_svc.service import EncoderService

    engine = EngineConfig(model="demo", demo_dir=str(tmp_path / "demo"), num_kv_blocks=256)
    empty = await asyncio.to_thread(start_redis)

    def cfg(name: str, redis_url: str = redis_server.url):
        return service_config(nats_server.url, redis_url, f"{name}-lost")

    services = [
        EncoderService(engine, cfg("encoder")),
        DecodeService(engine, cfg("decode")),
        PrefillService(engine, cfg("prefill", empty.url)),
    ]
    gw = channel = None
    try:
        await asyncio.gather(*(s.start() for s in services))
        gw = await start_gateway(engine, cfg("gateway"), aggregated=False)
        await gw.core.backend.registry.wait_for(gw.core.backend.ready, 30)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        out = await run(pbg.InferenceStub(channel), image_request(900, max_tokens=8), [])
        assert isinstance(out, list) and len(out) == 8, out
    finally:
        if channel is not None:
            await channel.close()
        if gw is not None:
            await gw.stop()
        await asyncio.gather(*(s.stop() for s in services))
        await asyncio.to_thread(empty.stop)
