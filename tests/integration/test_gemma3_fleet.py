"""Gemma 3 with images through the E/P/D fleet and `serve all` over real NATS and Redis,
called over gRPC: token-identical to transformers for text, one image, two images and a
multi-turn chat (the gateway spells out <start_of_image>, the encoder runs SigLIP and
the pooling projector, prefill sees each image bidirectionally, decode continues)."""

from __future__ import annotations

import io

import pytest
import pytest_asyncio
from PIL import Image

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from tests.helpers.checkpoints import make_gemma3_checkpoint, random_image
from tests.helpers.reference import gemma3_reference, load_hf
from tests.integration.stack import start_fleet_and_serve_all

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_NEW = 10


def _png(seed: int, size) -> bytes:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


CASES = {
    "text": [("user", ["a question with no image and enough words to pass the window"])],
    "one-image": [("user", [_png(1, (60, 90)), "what is in the picture"])],
    "two-images": [("user", ["compare", _png(2, (120, 50)), "with", _png(3, (33, 33))])],
    "multi-turn": [
        ("user", [_png(4, (40, 40)), "first look"]),
        ("assistant", ["a small square of noise"]),
        ("user", ["and now this one", _png(5, (90, 60))]),
    ],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3-fleet"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(ckpt, nats_server, redis_server):
    engine = EngineConfig(model=str(ckpt), block_size=16, num_kv_blocks=256)
    stacks = await start_fleet_and_serve_all(engine, nats_server.url, redis_server.url, "g3")
    yield stacks
    for stack in stacks:
        await stack.stop()


def _request(turns) -> pb.GenerateRequest:
    messages = [
        pb.ChatMessage(
            role=role,
            parts=[
                pb.ContentPart(text=p) if isinstance(p, str) else pb.ContentPart(image=p)
                for p in parts
            ],
        )
        for role, parts in turns
    ]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=messages), sampling=sp)


def _pil_messages(turns) -> list[dict]:
    return [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p}
                if isinstance(p, str)
                else {"type": "image", "image": Image.open(io.BytesIO(p)).convert("RGB")}
                for p in parts
            ],
        }
        for role, parts in turns
    ]


@pytest.mark.parametrize("case", list(CASES))
async def test_fleet_and_serve_all_match_transformers(stacks, ckpt, case):
    _, (ref, _) = gemma3_reference(ckpt, load_hf(ckpt), _pil_messages(CASES[case]), MAX_NEW)
    for stack in stacks:
        out = await stack.stub.GenerateOnce(_request(CASES[case]), timeout=120)
        assert list(out.token_ids) == ref
