"""Real photos through the fleet with NATS at its default 1 MiB max_payload: a 20 MB PNG
and a 12-megapixel JPEG are sent once (hash first), and an embedding larger than a
message reaches prefill when Redis is down. Checkpoints saved the transformers-5 way
(processor_config.json only) serve too."""

from __future__ import annotations

import io

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from launch.localstack import free_port
from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.metrics import IMAGES_ENCODED
from tests.helpers.checkpoints import make_llava_checkpoint
from tests.integration.stack import start_aggregated, start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def noise(width: int, height: int, fmt: str, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def chat(images: list[bytes], text: str = "what is this?", max_tokens: int = 4):
    parts = [pb.ContentPart(image=im) for im in images] + [pb.ContentPart(text=text)]
    return pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", parts=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


@pytest.fixture(scope="module")
def big_png() -> bytes:
    data = noise(2600, 2600, "PNG")
    assert len(data) > 20_000_000
    return data


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(tmp_path_factory, nats_server, redis_server):
    assert nats_server.url  # the default server: max_payload 1 MiB
    engine = EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=128
    )
    disagg = await start_disaggregated(
        engine, nats_server.url, redis_server.url, "big", num_decode=1
    )
    agg = await start_aggregated(engine, nats_server.url, redis_server.url, "big")
    yield disagg, agg
    await disagg.stop()
    await agg.stop()


async def test_a_20mb_png_is_sent_once_and_answers_like_the_aggregated_engine(stacks, big_png):
    disagg, agg = stacks
    assert disagg.gateway.core.backend.bus.max_payload == 1 << 20
    before_blobs, before_enc = disagg.encoder.blobs.received, IMAGES_ENCODED._value.get()
    ours = await disagg.stub.GenerateOnce(chat([big_png]), timeout=120)
    assert ours.token_ids == (await agg.stub.GenerateOnce(chat([big_png]), timeout=120)).token_ids
    again = await disagg.stub.GenerateOnce(chat([big_png], "and now?"), timeout=120)
    assert len(again.token_ids) == 4
    # The second request asked by hash and found the embedding: no bytes went again.
    assert disagg.encoder.blobs.received - before_blobs == 1
    assert IMAGES_ENCODED._value.get() - before_enc == 1  # the encoder ran once


async def test_a_12_megapixel_jpeg_and_small_images_in_one_request(stacks):
    disagg, agg = stacks
    photo = noise(4000, 3000, "JPEG", seed=1)
    assert len(photo) > 1 << 20
    req = chat([photo, noise(40, 30, "PNG", seed=2)])
    ours = await disagg.stub.GenerateOnce(req, timeout=120)
    assert ours.token_ids == (await agg.stub.GenerateOnce(req, timeout=120)).token_ids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis_down_stack(tmp_path_factory, nats_server):
    # 1024 image tokens x hidden 384 in fp32: 1.5 MiB per embedding, over max_payload.
    ckpt = make_llava_checkpoint(
        tmp_path_factory.mktemp("wide"),
        image_size=128,
        patch_size=4,
        hidden_size=384,
        max_position_embeddings=2048,
        nested_processor=True,
    )
    engine = EngineConfig(model=str(ckpt), num_kv_blocks=512)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    disagg = await start_disaggregated(engine, nats_server.url, dead, "wide", num_decode=1)
    agg = await start_aggregated(engine, nats_server.url, dead, "wide")
    yield disagg, agg
    await disagg.stop()
    await agg.stop()


async def test_an_embedding_over_max_payload_reaches_prefill_with_redis_down(redis_down_stack):
    disagg, agg = redis_down_stack
    before = disagg.prefill.blobs.received
    req = chat([noise(200, 150, "PNG", seed=3)], max_tokens=3)
    req.sampling.n = 2  # both choices use the one embedding the encoder pushed
    ours = await disagg.stub.GenerateOnce(req, timeout=120)
    ref = await agg.stub.GenerateOnce(req, timeout=120)
    assert [c.token_ids for c in ours.choices] == [c.token_ids for c in ref.choices]
    assert len(ours.choices) == 2 and ours.usage.prompt_tokens > 1024
    assert disagg.prefill.blobs.received - before == 1


async def test_a_repeat_with_redis_down_is_not_encoded_again(redis_down_stack):
    # Redis never took the embedding; the encoder's own LRU answers the repeat, pushing
    # the embedding to prefill again.
    disagg, agg = redis_down_stack
    req = chat([noise(90, 60, "PNG", seed=4)], max_tokens=3)
    before_enc, before_blobs = IMAGES_ENCODED._value.get(), disagg.prefill.blobs.received
    first = await disagg.stub.GenerateOnce(req, timeout=120)
    again = await disagg.stub.GenerateOnce(req, timeout=120)
    assert IMAGES_ENCODED._value.get() - before_enc == 1
    assert disagg.prefill.blobs.received - before_blobs == 2
    ref = await agg.stub.GenerateOnce(req, timeout=120)
    assert first.token_ids == again.token_ids == ref.token_ids
