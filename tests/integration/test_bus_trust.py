"""Trust on the bus: a peer that publishes garbage on a worker's or a gateway's subject
fails only what it forged, and nothing else moves.

(a) Malformed KV transfers to a decode instance (wrong dtype, shape, byte count,
    header naming another request) each get an INVALID_ARGUMENT reply, give back every
    block they reserved, and the real streams decoding there meanwhile keep their tokens.
(b) Forged token batches on the gateway's ``epd.out.<id>`` for a live request, from an
    instance that does not hold it or at an offset its sender never speaks at, leave the
    client's stream equal to an undisturbed run (and count in DROPPED_UPDATES).
(c) A prefill request whose embedding (from Redis, or pushed as a blob) has the wrong
    shape or dtype fails alone with INVALID_ARGUMENT; requests beside it complete.

One in-process fleet (the demo VLM: encoder, prefill, one decode, gateway) on real NATS
and Redis; greedy decoding, so "correct tokens" means "equal to the same request run
undisturbed".
"""

from __future__ import annotations

import asyncio
import io
import time
import uuid

import grpc
import pytest
import pytest_asyncio
import torch

from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb
from services.bus import subjects
from services.bus.blobs import send_blob
from services.bus.chunked import send_chunked
from services.bus.codec import dtype_name
from services.bus.connection import Bus, BusConfig
from services.bus.messages import encode
from services.config import EngineConfig
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig, pack_embedding
from services.image_checks import image_hash
from services.kv_connector import NatsKVSender
from services.metrics import DROPPED_UPDATES
from services.wire import spans_to_proto
from tests.helpers.checkpoints import random_image
from tests.integration.stack import start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

INVALID = bus_pb2.ERROR_CODE_INVALID_ARGUMENT
# Every wait in this file is bounded by this (a hang fails the test, it does not stall it).
WAIT_S = 60.0


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    return EngineConfig(
        model="demo",
        demo_dir=str(tmp_path_factory.mktemp("demo")),
        block_size=16,
        num_kv_blocks=256,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(engine_config, nats_server, redis_server):
    # Default heartbeat and TTL: a late beat under load must not move the streams that
    # these tests compare token by token (start_disaggregated's ``lenient``).
    s = await start_disaggregated(
        engine_config, nats_server.url, redis_server.url, "trust", num_decode=1, lenient=True
    )
    yield s
    await s.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def peer(nats_server):
    """A bus connection that belongs to no service: the forger."""
    bus = await Bus.connect(BusConfig(servers=(nats_server.url,), name="peer", drain_timeout_s=2))
    yield bus
    await bus.close()


def png(seed: int, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def chat(text: str, images=(), max_tokens: int = 24) -> pb.GenerateRequest:
    parts = [pb.ContentPart(image=im) for im in images] + [pb.ContentPart(text=text)]
    msg = pb.ChatMessage(role="user", parts=parts)
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def collect(stub, req, got: list[int] | None = None) -> list[int]:
    got = [] if got is None else got
    async for resp in stub.Generate(req, timeout=WAIT_S):
        got += resp.token_ids
    return got


def start_streams(stub, reqs) -> tuple[list[asyncio.Task], list[list[int]]]:
    """Every request as a stream task, and the tokens each has received so far."""
    got: list[list[int]] = [[] for _ in reqs]
    return [asyncio.create_task(collect(stub, r, g)) for r, g in zip(reqs, got, strict=True)], got


async def eventually(predicate, what, timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` (state another thread or connection settles) within a bound;
    on timeout fail with ``what`` (a string, or a function that describes the state)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(what() if callable(what) else what)


async def all_started(got: list[list[int]], n: int) -> None:
    """Every stream has ``n`` tokens (token 1 is prefill's; from 2 on decode holds it)."""
    await eventually(
        lambda: all(len(g) >= n for g in got), f"streams never reached {n} tokens", WAIT_S
    )


# ------------------------------------------------------------------- (a) KV transfers


def _kv_case(decode, case: str, num_tokens: int):
    """(KvHeader, payload bytes) of one malformed transfer for ``num_tokens`` tokens."""
    layers, bs, heads, dim, dtype = decode.receiver.expected
    blocks = -(-num_tokens // bs)
    good = torch.zeros(2, layers, blocks, bs, heads, dim, dtype=decode.engine.engine.loaded.dtype)
    assert dtype_name(good.dtype) == dtype
    if case == "dtype":  # same shape, other element type (and so other byte count)
        kv = good.to(torch.float16 if good.dtype != torch.float16 else torch.float32)
    elif case == "blocks":  # layout right, one block more than the request reserved
        kv = torch.zeros(2, layers, blocks + 1, bs, heads, dim, dtype=good.dtype)
    elif case == "head_dim":
        kv = torch.zeros(2, layers, blocks, bs, heads, dim + 1, dtype=good.dtype)
    else:
        kv = good
    layout = bus_pb2.KvLayout(
        num_layers=kv.shape[1],
        num_kv_heads=kv.shape[4],
        head_dim=kv.shape[5],
        block_size=kv.shape[3],
        dtype=dtype_name(kv.dtype),
        shape=list(kv.shape),
    )
    payload = kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    header = bus_pb2.KvHeader(
        request_id=f"forged-{case}", num_tokens=num_tokens, layout=layout, total_bytes=len(payload)
    )
    if case == "bytes":  # the header promises the shape; the payload is one element short
        payload = payload[: -good.element_size()]
    elif case == "other_request":
        header.request_id = "somebody-else"
    elif case == "num_tokens":
        header.num_tokens = num_tokens - 1
    return header, payload


async def _forge_transfer(peer: Bus, decode, case: str, token_id: int) -> bus_pb2.DecodeReply:
    """A DecodeRequest and its (malformed) KV, sent together as prefill's hand-off does."""
    num_tokens = 40
    rid, tid = f"forged-{case}", f"forged-{case}-{uuid.uuid4().hex[:8]}"
    dreq = bus_pb2.DecodeRequest(
        request_id=rid,
        gateway_id="forger",
        token_ids=[token_id] * num_tokens,
        num_prompt_tokens=num_tokens,
        first_token_id=token_id,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=8),
        kv_transfer_id=tid,
        deadline_unix_ms=int((time.time() + 30) * 1000),
    )
    header, payload = _kv_case(decode, case, num_tokens)
    adopt = asyncio.create_task(
        peer.request(
            subjects.decode(decode.model_fingerprint, decode.instance_id),
            dreq,
            bus_pb2.DecodeReply,
            30,
        )
    )
    # The receiver takes the whole payload before it validates it: the send completes.
    await send_chunked(
        peer,
        subjects.kv(decode.instance_id),
        encode(header),
        payload,
        timeout_s=30,
        transfer_id=tid,
    )
    return await asyncio.wait_for(adopt, WAIT_S)


KV_CASES = ("dtype", "blocks", "head_dim", "bytes", "other_request", "num_tokens")


async def test_malformed_kv_transfers_are_refused_and_leave_decode_untouched(stack, peer):
    decode = stack.decodes[0]
    llm = decode.engine.engine
    reqs = [chat(f"tell me a long story number {i}", max_tokens=160) for i in range(4)]
    reference = [await collect(stack.stub, r) for r in reqs]
    free_before = decode.engine.load()["free_blocks"]
    streams, got = start_streams(stack.stub, reqs)
    await all_started(got, 2)
    replies, unfinished_at_reply = {}, []
    for case in KV_CASES:
        replies[case] = await _forge_transfer(peer, decode, case, reference[0][0])
        unfinished_at_reply.append(sum(not s.done() for s in streams))
    async with asyncio.timeout(WAIT_S):
        outs = await asyncio.gather(*streams)
    for case, reply in replies.items():
        assert reply.HasField("error") and reply.error.code == INVALID, (case, reply)
    assert outs == reference
    # Not vacuous: real streams were decoding there while the first forgeries came in.
    assert unfinished_at_reply[0] > 0, unfinished_at_reply
    await eventually(lambda: not llm.has_unfinished_requests(), "decode still busy")
    assert decode.engine.load()["free_blocks"] == free_before
    assert not llm.imports.reserved
    assert not any(rid.startswith("forged-") for rid in llm.states)
    assert not any(rid.startswith("forged-") for rid in decode.routes)


async def test_kv_sender_with_a_foreign_dtype_is_refused(stack, peer):
    """The same through the real sender (NatsKVSender), as a misconfigured prefill would."""
    decode = stack.decodes[0]
    free_before = decode.engine.load()["free_blocks"]
    layers, bs, heads, dim, dtype = decode.receiver.expected
    foreign = torch.bfloat16 if dtype != "bfloat16" else torch.float16
    kv = torch.ones(2, layers, 2, bs, heads, dim, dtype=foreign)
    rid, tid = "forged-sender", f"forged-sender-{uuid.uuid4().hex[:8]}"
    dreq = bus_pb2.DecodeRequest(
        request_id=rid,
        gateway_id="forger",
        token_ids=[5] * 20,
        num_prompt_tokens=20,
        first_token_id=5,
        kv_transfer_id=tid,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=4),
        deadline_unix_ms=int((time.time() + 30) * 1000),
    )
    adopt = asyncio.create_task(
        peer.request(
            subjects.decode(decode.model_fingerprint, decode.instance_id),
            dreq,
            bus_pb2.DecodeReply,
            30,
        )
    )
    await NatsKVSender(peer).send(decode.instance_id, tid, rid, kv, 20, 30)
    reply = await asyncio.wait_for(adopt, WAIT_S)
    assert reply.error.code == INVALID and "layout" in reply.error.message
    assert decode.engine.load()["free_blocks"] == free_before
    # ...and the next real request there is served normally.
    assert len(await collect(stack.stub, chat("after the forgery", max_tokens=8))) == 8


# ---------------------------------------------------------------- (b) token batches


async def _live_route(gw, timeout_s: float = WAIT_S):
    """(attempt id, Route) of the one request in flight on the gateway."""
    routes = gw.core.backend.routes
    await eventually(lambda: len(routes) == 1, "no request in flight", timeout_s)
    return next(iter(routes.items()))


async def test_forged_token_batches_change_nothing_in_the_stream(stack, peer):
    gw = stack.gateway
    out = subjects.out(gw.core.backend.gateway_id)
    req = chat("count slowly to one hundred", max_tokens=400)
    reference = await collect(stack.stub, req)
    got: list[int] = []
    stream = asyncio.create_task(collect(stack.stub, req, got))
    await all_started([got], 20)
    arid, route = await _live_route(gw)
    before = DROPPED_UPDATES._value.get()

    def batch(sender: str, offset: int, tokens=(7, 7, 7), finish=pb.FINISH_REASON_UNSPECIFIED):
        upd = bus_pb2.TokenUpdate(
            request_id=arid, token_ids=list(tokens), offset=offset, finish_reason=finish
        )
        return bus_pb2.TokenBatch(instance_id=sender, updates=[upd])

    here = len(got)
    forged = [
        # an instance that holds nothing of it, at the very next offset
        batch("intruder", here + 1),
        batch(route.decode_id + "x", here + 2, finish=pb.FINISH_REASON_STOP),
        # the request's own prefill instance, at an offset prefill never speaks at
        batch(route.prefill_id, here + 3, finish=pb.FINISH_REASON_STOP),
        # its own decode, replaying offsets the client already has
        batch(route.decode_id, 1, tokens=(9,)),
        batch(route.decode_id, here - 1, tokens=(9, 9)),
        # its own prefill, replaying token 1
        batch(route.prefill_id, 0, tokens=(9,)),
        # its own decode, far past the end of the request
        batch(route.decode_id, 100_000, tokens=(9,), finish=pb.FINISH_REASON_STOP),
    ]
    for b in forged:
        await peer.publish(out, b)
    # Messages of one connection on one subject arrive in order: when this last refusal
    # is counted, the gateway has handled every forgery above with the route still live.
    await peer.publish(out, batch("sentinel", here + 1))
    # Refused at the door: intruder, the look-alike, both prefill forgeries (prefill is
    # done once decode speaks) and the sentinel; decode's replays pass the door and the
    # orderer drops them as duplicates, the one far past the end waits there unused.
    await eventually(
        lambda: DROPPED_UPDATES._value.get() - before >= 5,
        lambda: (
            f"refusals counted: {DROPPED_UPDATES._value.get() - before} of 5; "
            f"routes now: {gw.core.backend.routes}"
        ),
    )
    assert DROPPED_UPDATES._value.get() - before == 5
    assert not stream.done(), "the stream ended before the forgeries arrived: vacuous"
    async with asyncio.timeout(WAIT_S):
        assert await stream == reference


async def test_a_forged_prefill_error_after_the_hand_off_changes_nothing(stack, peer):
    gw = stack.gateway
    out = subjects.out(gw.core.backend.gateway_id)
    req = chat("count slowly to two hundred", max_tokens=400)
    reference = await collect(stack.stub, req)
    got: list[int] = []
    stream = asyncio.create_task(collect(stack.stub, req, got))
    await all_started([got], 20)
    arid, route = await _live_route(gw)
    assert route.decode_spoke
    upd = bus_pb2.TokenUpdate(
        request_id=arid, offset=len(got) + 5, finish_reason=pb.FINISH_REASON_ERROR
    )
    upd.error.CopyFrom(bus_pb2.Error(code=INVALID, message="forged"))
    await peer.publish(out, bus_pb2.TokenBatch(instance_id=route.prefill_id, updates=[upd]))
    async with asyncio.timeout(WAIT_S):
        assert await stream == reference


# ------------------------------------------------------------------ (c) embeddings


async def _store(redis_url: str) -> EmbeddingStore:
    return EmbeddingStore.from_config(EmbeddingStoreConfig(url=redis_url, op_timeout_s=2.0))


async def test_a_bad_cached_embedding_fails_only_its_own_request(stack, redis_server):
    gw = stack.gateway
    fp = gw.core.info.fingerprint
    store = await _store(redis_server.url)
    try:
        good_img = png(501)
        good = [
            chat("what is in the picture", [good_img], max_tokens=120),
            chat("no picture at all, just talk", max_tokens=120),
        ]
        reference = [await collect(stack.stub, r) for r in good]
        emb = await store.get(fp, image_hash(good_img, fp))
        assert emb is not None and emb.dim() == 2
        bad = {  # image seed -> the tensor planted under its hash
            502: emb[:-1],  # one row short of the image's placeholders
            503: emb[:, :-1],  # a hidden size the model does not have
            504: emb.to(torch.int32),  # the right shape, not floats
            505: emb.reshape(1, *emb.shape),  # three dimensions
        }
        for seed, tensor in bad.items():
            assert await store.put(fp, image_hash(png(seed), fp), tensor.contiguous())
        streams, got = start_streams(stack.stub, good)
        await all_started(got, 1)
        bad_calls = [collect(stack.stub, chat("what is this", [png(seed)])) for seed in bad]
        async with asyncio.timeout(WAIT_S):
            failures = await asyncio.gather(*bad_calls, return_exceptions=True)
            running_when_failed = sum(not s.done() for s in streams)
            outs = await asyncio.gather(*streams)
        for seed, f in zip(bad, failures, strict=True):
            assert isinstance(f, grpc.aio.AioRpcError), (seed, f)
            assert f.code() == grpc.StatusCode.INVALID_ARGUMENT, (seed, f.details())
            assert "embedding" in f.details()
        assert outs == reference
        assert running_when_failed > 0  # they failed while the good ones were being served
    finally:
        await store.close()


async def test_a_bad_pushed_embedding_fails_only_its_own_prefill_request(stack, peer):
    """The blob path: a PrefillRequest forged on ``epd.prefill.<id>`` whose span points at
    an embedding pushed to the prefill's blob inbox."""
    gw, prefill = stack.gateway, stack.prefill
    image = png(601)
    prep = await gw.core.prepare(
        model="",
        params={"temperature": 0.0, "max_tokens": 4},
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "look"}],
            }
        ],
    )
    (span,) = prep.spans
    hidden = prefill.engine.engine.loaded.text_config.hidden_size
    payloads = {
        "rows": pack_embedding(torch.zeros(span.length + 3, hidden)),
        "dtype": pack_embedding(torch.zeros(span.length, hidden, dtype=torch.int64)),
        "garbage": b"EPDE not an embedding at all",
    }
    good = chat("a request beside the forged ones", max_tokens=60)
    reference = await collect(stack.stub, good)
    beside = asyncio.create_task(collect(stack.stub, good))

    async def forged(case: str, data: bytes) -> bus_pb2.PrefillReply:
        ref = await send_blob(peer, prefill.instance_id, data, 30)
        (pspan,) = spans_to_proto(prep.spans, {})
        pspan.embedding_ref.CopyFrom(ref)
        req = bus_pb2.PrefillRequest(
            request_id=f"forged-prefill-{case}",
            gateway_id="forger",
            decode_instance_id=stack.decodes[0].instance_id,
            prompt_token_ids=prep.prompt_token_ids,
            image_spans=[pspan],
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=4),
            deadline_unix_ms=int((time.time() + 30) * 1000),
            max_model_len=gw.core.info.max_model_len,
        )
        return await peer.request(
            subjects.prefill(prefill.model_fingerprint, prefill.instance_id),
            req,
            bus_pb2.PrefillReply,
            30,
        )

    async with asyncio.timeout(WAIT_S):
        replies = await asyncio.gather(*(forged(c, d) for c, d in payloads.items()))
        assert await beside == reference
    for case, reply in zip(payloads, replies, strict=True):
        assert reply.error.code == INVALID, (case, reply)
    assert not any(r.startswith("forged-") for r in prefill.routes)
    assert not any(r.startswith("forged-") for r in prefill.engine.engine.states)
