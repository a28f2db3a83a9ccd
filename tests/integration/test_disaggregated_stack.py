"""The E/P/D fleet (1 encoder, 1 prefill, 2 decode, gateway) over real NATS and Redis,
against the aggregated engine behind the same gRPC API."""

from __future__ import annotations

import asyncio
import io

import grpc
import pytest
import pytest_asyncio
import torch

from gateway.config import GatewayConfig
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from services.metrics import IMAGES_ENCODED, KV_BYTES_SENT
from tests.helpers.checkpoints import random_image
from tests.integration.stack import (
    service_config,
    start_aggregated,
    start_disaggregated,
    start_gateway,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def png(seed: int, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    return EngineConfig(
        model="demo",
        demo_dir=str(tmp_path_factory.mktemp("demo")),
        block_size=16,
        num_kv_blocks=256,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(engine_config, nats_server, redis_server):
    disagg = await start_disaggregated(engine_config, nats_server.url, redis_server.url, "t1")
    agg = await start_aggregated(engine_config, nats_server.url, redis_server.url, "t1")
    yield disagg, agg
    await disagg.stop()
    await agg.stop()


def chat_request(
    text: str, images: list[bytes], max_tokens: int = 12, **sampling
) -> pb.GenerateRequest:
    parts = [pb.ContentPart(image=im) for im in images] + [pb.ContentPart(text=text)]
    msg = pb.ChatMessage(role="user", parts=parts)
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
    return pb.GenerateRequest(model="demo", chat=pb.Chat(messages=[msg]), sampling=sp)


async def collect(stub, req) -> tuple[list[int], str, int]:
    ids, text, finish = [], "", 0
    async for resp in stub.Generate(req):
        ids += list(resp.token_ids)
        text += resp.text
        finish = resp.finish_reason or finish
    return ids, text, finish


async def test_disaggregated_equals_aggregated_under_16_streams(stacks):
    disagg, agg = stacks
    reqs = [
        chat_request(f"question number {i} about the picture", [png(100 + j) for j in range(i % 4)])
        for i in range(16)
    ]
    before = [d.adopted for d in disagg.decodes]
    ours = await asyncio.gather(*(collect(disagg.stub, r) for r in reqs))
    ref = await asyncio.gather(*(collect(agg.stub, r) for r in reqs))
    assert ours == ref
    assert all(len(ids) == 12 or finish == pb.FINISH_REASON_STOP for ids, _, finish in ours)
    assert all(d.adopted > b for d, b in zip(disagg.decodes, before, strict=True))


async def test_stop_strings_end_the_request_at_the_gateway(stacks):
    disagg, agg = stacks
    _, full_text, _ = await collect(agg.stub, chat_request("say something", [], max_tokens=16))
    words = full_text.split()
    stop = words[len(words) // 2]
    req = chat_request("say something", [], max_tokens=16, stop=[stop])
    for stack in (disagg, agg):
        _, text, finish = await collect(stack.stub, req)
        assert finish == pb.FINISH_REASON_STOP
        assert stop not in text and full_text.startswith(text)


async def test_repeated_image_is_encoded_once(stacks):
    disagg, _ = stacks
    image = png(7, (64, 64))
    before = IMAGES_ENCODED._value.get()
    outs = await asyncio.gather(
        *(collect(disagg.stub, chat_request(f"look {i}", [image])) for i in range(4))
    )
    outs.append(await collect(disagg.stub, chat_request("look again", [image])))
    assert IMAGES_ENCODED._value.get() - before == 1
    assert all(ids for ids, _, _ in outs)


async def test_an_image_encoded_while_another_request_for_it_waited_is_not_encoded_again(stacks):
    """The race under load: a request's lookup misses while the first encode of its image
    runs, its image bytes arrive after that encode (and its single flight) ended; it
    takes the embedding encoded here instead of a second tower pass."""
    from PIL import Image

    from services.images import image_hash
    from services.models.image_grid import ImageOptions

    disagg, _ = stacks
    enc = disagg.encoder
    data = png(11, (56, 48))
    digest = image_hash(data, enc.fingerprint)
    item = (Image.open(io.BytesIO(data)).convert("RGB"), ImageOptions())
    before = IMAGES_ENCODED._value.get()
    first, _ = await enc._encode_and_store(item, digest)
    second, _ = await enc._encode_and_store(item, digest)
    assert IMAGES_ENCODED._value.get() - before == 1
    assert torch.equal(first, second)


async def test_kv_larger_than_max_payload_transfers_intact(stacks):
    disagg, agg = stacks
    max_payload = disagg.gateway.core.backend.bus.max_payload
    words = " ".join(f"word{i}" for i in range(230))
    req = chat_request(words, [], max_tokens=6)
    before = KV_BYTES_SENT._value.get()
    ours = await collect(disagg.stub, req)
    assert KV_BYTES_SENT._value.get() - before > max_payload
    assert ours == await collect(agg.stub, req)


async def _quiescent(stack, free0: dict) -> bool:
    engines = [stack.prefill.engine, *(d.engine for d in stack.decodes)]
    for eng in engines:
        if eng.engine.has_unfinished_requests():
            return False
        if eng.engine.block_manager.num_free_blocks != free0[id(eng)]:
            return False
    return True


async def test_cancel_frees_kv_blocks_on_prefill_and_decode(stacks):
    disagg, _ = stacks
    engines = [disagg.prefill.engine, *(d.engine for d in disagg.decodes)]
    free0 = {id(e): e.engine.block_manager.num_free_blocks for e in engines}
    call = disagg.stub.Generate(
        chat_request("tell me a long story", [], max_tokens=1500, ignore_eos=True)
    )
    got = 0
    async for resp in call:
        got += len(resp.token_ids)
        if got >= 3:
            break
    call.cancel()
    for _ in range(200):
        if await _quiescent(disagg, free0):
            break
        await asyncio.sleep(0.05)
    assert await _quiescent(disagg, free0)


@pytest.mark.parametrize(
    "mutate,code",
    [
        (lambda r: r.sampling.__setattr__("temperature", -1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.sampling.__setattr__("top_p", 0.0), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.sampling.__setattr__("max_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.__setattr__("model", "no-such-model"), grpc.StatusCode.NOT_FOUND),
        (
            lambda r: r.chat.messages[0].parts.append(pb.ContentPart(image=b"not an image")),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda r: r.chat.messages[0].parts.append(pb.ContentPart(text=" x" * 3000)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (lambda r: r.ClearField("chat"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_input_gets_a_status_and_service_keeps_serving(stacks, mutate, code):
    disagg, _ = stacks
    req = chat_request("hello", [])
    mutate(req)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await disagg.stub.GenerateOnce(req)
    assert err.value.code() == code
    assert err.value.details()
    ok = await disagg.stub.GenerateOnce(chat_request("hello again", [], max_tokens=3))
    assert len(ok.token_ids) >= 1


async def test_undecodable_request_bytes_get_invalid_argument(stacks):
    disagg, _ = stacks
    raw = disagg.channel.unary_unary("/epd.v1.Inference/GenerateOnce")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(b"\xff\xff\xff\xff")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in err.value.details()


async def test_health_and_reflection(stacks):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    disagg, _ = stacks
    health = health_pb2_grpc.HealthStub(disagg.channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service="epd.v1.Inference"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    sync_channel = grpc.insecure_channel(f"127.0.0.1:{disagg.gateway.grpc_port}")
    try:
        services = await asyncio.to_thread(
            lambda: ProtoReflectionDescriptorDatabase(sync_channel).get_services()
        )
    finally:
        sync_channel.close()
    assert "epd.v1.Inference" in services


async def _choices(stub, req) -> tuple[dict[int, list[int]], dict[int, int], pb.Usage]:
    ids: dict[int, list[int]] = {}
    finishes: dict[int, int] = {}
    usage = None
    async for resp in stub.Generate(req):
        ids.setdefault(resp.index, []).extend(resp.token_ids)
        if resp.finish_reason:
            assert resp.index not in finishes  # one finish per choice
            finishes[resp.index] = resp.finish_reason
        if resp.HasField("usage"):
            usage = resp.usage
    return ids, finishes, usage


async def test_n_choices_are_the_same_on_the_fleet_and_the_engine(stacks):
    disagg, agg = stacks
    req = chat_request("pick a few words", [png(21)], max_tokens=8)
    req.sampling.temperature, req.sampling.seed, req.sampling.n = 0.9, 77, 3
    ours, finishes, usage = await _choices(disagg.stub, req)
    ref, _, _ = await _choices(agg.stub, req)
    assert ours == ref and sorted(ours) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert len({tuple(v) for v in ours.values()}) == 3
    assert usage.completion_tokens == sum(len(v) for v in ours.values())
    once = await disagg.stub.GenerateOnce(req)
    assert {c.index: list(c.token_ids) for c in once.choices} == ours
    assert list(once.token_ids) == ours[0]


async def test_client_ids_are_echoed_and_never_collide(stacks):
    disagg, _ = stacks
    reqs = [chat_request(f"same id, question {i}", [], max_tokens=10) for i in range(4)]
    solo = [await disagg.stub.GenerateOnce(r) for r in reqs]
    for r in reqs:
        r.request_id = "same-id"
    together = await asyncio.gather(*(disagg.stub.GenerateOnce(r) for r in reqs))
    assert [t.token_ids for t in together] == [s.token_ids for s in solo]
    assert {t.request_id for t in together} == {"same-id"}
    huge = chat_request("a huge id", [], max_tokens=3)
    huge.request_id = "x" * 10_000
    out = await disagg.stub.GenerateOnce(huge)
    assert out.request_id == huge.request_id and len(out.token_ids) == 3


async def test_a_rest_client_that_disconnects_aborts_on_every_service(stacks):
    import httpx

    disagg, _ = stacks
    engines = [disagg.prefill.engine, *(d.engine for d in disagg.decodes)]
    free0 = {id(e): e.engine.block_manager.num_free_blocks for e in engines}
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    base = f"http://127.0.0.1:{disagg.gateway.http_port}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        chunks = 0
        async for line in resp.aiter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break
        decode = next(d for d in disagg.decodes if d.routes)
        rid = next(iter(decode.routes))
    for _ in range(200):
        if rid in decode.aborted and await _quiescent(disagg, free0):
            break
        await asyncio.sleep(0.05)
    assert rid in decode.aborted  # the decode instance was told, not left to run 1500 tokens
    assert await _quiescent(disagg, free0)


async def test_short_text_prompts_prefill_on_the_decode_instance(
    stacks, engine_config, nats_server, redis_server
):
    """Conditional disaggregation: same tokens, no KV transfer, no hand-off; image
    prompts still go through prefill."""
    disagg, agg = stacks
    cfg = service_config(nats_server.url, redis_server.url, "gateway-local-t1")
    gw = await start_gateway(
        engine_config,
        cfg,
        aggregated=False,
        api=GatewayConfig(http_port=0, max_local_prefill_tokens=512),
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
    try:
        stub = pbg.InferenceStub(channel)
        await gw.core.backend.registry.wait_for(gw.core.backend.ready, timeout_s=10)
        adopted, sent = sum(d.adopted for d in disagg.decodes), KV_BYTES_SENT._value.get()
        for text in ("a short question", "another one"):
            req = chat_request(text, [], max_tokens=20, ignore_eos=True)
            assert (await collect(stub, req))[0] == (await collect(agg.stub, req))[0]
        assert sum(d.adopted for d in disagg.decodes) == adopted  # no hand-off happened
        assert KV_BYTES_SENT._value.get() == sent
        with_image = chat_request("and this?", [png(11)])
        assert (await collect(stub, with_image))[0] == (await collect(agg.stub, with_image))[0]
        assert sum(d.adopted for d in disagg.decodes) == adopted + 1
    finally:
        await channel.close()
        await gw.stop()


@pytest.mark.parametrize(
    "field",
    [
        {"stop": [f"s{i}" for i in range(10_000)]},
        {"stop_token_ids": list(range(10_000))},
        {"stop": ["x" * 10_000]},
        {"n": 10_000},
        {"logprobs": 10_000},
    ],
    ids=["stop strings", "stop token ids", "stop length", "n", "logprobs"],
)
async def test_unbounded_fields_are_refused_and_the_gateway_keeps_serving(stacks, field):
    disagg, _ = stacks
    req = chat_request("bounded", [], max_tokens=3)
    for name, value in field.items():
        target = getattr(req.sampling, name)
        if isinstance(value, list):
            target.extend(value)
        else:
            setattr(req.sampling, name, value)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await disagg.stub.GenerateOnce(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len((await disagg.stub.GenerateOnce(chat_request("still fine", []))).token_ids)
