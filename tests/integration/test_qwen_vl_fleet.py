"""Qwen2.5-VL and Qwen3-VL (images of their own token counts, M-RoPE; Qwen3-VL's
DeepStack features ride in the embedding) through the E/P/D fleet and `serve all` over
real NATS and Redis, called over gRPC and with the openai client: token-identical to
transformers; a repeated image is encoded once fleet-wide; mm_processor_kwargs change
the image's tokens and are checked."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import pytest_asyncio
import torch

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.metrics import IMAGES_ENCODED
from tests.helpers.checkpoints import (
    make_qwen2_5_vl_checkpoint,
    make_qwen3_vl_checkpoint,
    random_image,
)
from tests.helpers.reference import hf_greedy, load_hf
from tests.helpers.tower import Tower
from tests.integration.stack import start_fleet_and_serve_all

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_NEW = 10


def _png(seed: int, size) -> bytes:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def _part(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


MAKE = {"qwen2_5_vl": make_qwen2_5_vl_checkpoint, "qwen3_vl": make_qwen3_vl_checkpoint}


@pytest.fixture(scope="module", params=list(MAKE))
def ckpt(request, tmp_path_factory):
    return MAKE[request.param](tmp_path_factory.mktemp(request.param))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(ckpt, nats_server, redis_server):
    engine = EngineConfig(model=str(ckpt), block_size=16, num_kv_blocks=256)
    stacks = await start_fleet_and_serve_all(engine, nats_server.url, redis_server.url, "qvl")
    yield stacks
    for stack in stacks:
        await stack.stop()


def _client(stack) -> openai.AsyncOpenAI:
    port = stack.gateway.http_port
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def _reference(ckpt, messages, images: list[bytes], max_pixels=None) -> list[int]:
    """transformers' greedy tokens for the chat (rendered and expanded as its own
    processor does)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    hf = load_hf(ckpt)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    plain = [
        {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    ids = tok.encode(
        tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    proc = AutoImageProcessor.from_pretrained(str(ckpt), backend="pil")
    kw = {}
    if max_pixels:
        kw["size"] = {"shortest_edge": proc.size.shortest_edge, "longest_edge": max_pixels}
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(images=pil, return_tensors="pt", **kw)
    pad = hf.config.image_token_id
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    expanded = [t for x in ids for t in ([x] * next(counts) if x == pad else [x])]
    ref, _ = hf_greedy(
        hf,
        expanded,
        MAX_NEW,
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=(torch.tensor([expanded]) == pad).int(),
    )
    return ref


async def _tokens(stack, messages, mm_processor_kwargs=None) -> list[int]:
    """Greedy token ids over gRPC (the chat's images as content parts)."""
    parts = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        msg = pb.ChatMessage(role=m["role"])
        for p in content:
            if p["type"] == "text":
                msg.parts.append(pb.ContentPart(text=p["text"]))
            else:
                data = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                msg.parts.append(pb.ContentPart(image=data))
        parts.append(msg)
    req = pb.GenerateRequest(
        chat=pb.Chat(messages=parts),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        mm_processor_kwargs=json.dumps(mm_processor_kwargs) if mm_processor_kwargs else "",
    )
    return list((await stack.stub.GenerateOnce(req, timeout=120)).token_ids)


CASES = {
    "one-image": [
        {"role": "user", "content": [_part(_png(1, (60, 90))), {"type": "text", "text": "what"}]}
    ],
    "two-sizes": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                _part(_png(2, (120, 50))),
                _part(_png(3, (200, 140))),
            ],
        }
    ],
    "multi-turn": [
        {"role": "user", "content": [_part(_png(4, (33, 33))), {"type": "text", "text": "look"}]},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, _part(_png(5, (90, 60)))]},
    ],
}


def _images(messages) -> list[bytes]:
    return [
        base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    ]


@pytest.mark.parametrize("case", list(CASES))
async def test_fleet_and_serve_all_match_transformers(stacks, ckpt, case):
    messages = CASES[case]
    ref = _reference(ckpt, messages, _images(messages))
    for stack in stacks:
        assert await _tokens(stack, messages) == ref


async def test_a_repeated_image_is_encoded_once(stacks):
    """The second request with the image (another question) costs no tower pass: its
    variable-length embedding comes back from Redis, in the fleet and in serve all."""
    fleet, agg = stacks
    messages = [
        {"role": "user", "content": [_part(_png(40, (150, 100))), {"type": "text", "text": "x"}]}
    ]
    tower = Tower(agg.gateway.core.backend)  # serve all's passes
    first = await _tokens(fleet, messages)
    assert await _tokens(agg, messages) == first
    before, passes = IMAGES_ENCODED._value.get(), tower.passes  # the fleet's encoder's
    again = [
        {**messages[0], "content": [*messages[0]["content"][:1], {"type": "text", "text": "y"}]}
    ]
    assert await _tokens(fleet, again) == await _tokens(agg, again)
    assert IMAGES_ENCODED._value.get() == before and tower.passes == passes


async def test_mm_processor_kwargs_reach_the_encoder(stacks, ckpt):
    messages = CASES["one-image"]
    small = 28 * 28 * 4
    ref = _reference(ckpt, messages, _images(messages), max_pixels=small)
    for stack in stacks:
        assert await _tokens(stack, messages, {"max_pixels": small}) == ref
        # The REST API takes them too (vLLM's extra body field), and refuses bad ones.
        client = _client(stack)
        out = await client.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_body={"ignore_eos": True, "mm_processor_kwargs": {"max_pixels": small}},
        )
        assert out.usage.completion_tokens == MAX_NEW
        assert out.usage.prompt_tokens < (await _prompt_tokens(client, messages))
        with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs"):
            await client.chat.completions.create(
                model="",
                messages=messages,
                max_tokens=2,
                extra_body={"mm_processor_kwargs": {"max_pixels": "many"}},
            )


async def _prompt_tokens(client, messages) -> int:
    out = await client.chat.completions.create(
        model="", messages=messages, max_tokens=1, temperature=0
    )
    return out.usage.prompt_tokens


async def test_tokenize_counts_each_image_by_its_size(stacks):
    """/tokenize with images in the messages gives the prompt the model sees: as many
    tokens as a completion's usage reports."""
    import httpx

    for stack in stacks:
        messages = CASES["two-sizes"]
        url = f"http://127.0.0.1:{stack.gateway.http_port}/tokenize"
        async with httpx.AsyncClient() as http:
            resp = await http.post(url, json={"messages": messages})
        assert resp.status_code == 200, resp.text
        got = resp.json()
        assert got["count"] == await _prompt_tokens(_client(stack), messages)
