"""`serve all`'s image-embedding cache: a repeated image skips the vision tower."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gateway.aggregated import AggregatedBackend
from gateway.prepare import PreparedRequest, RequestPreparer
from launch.localstack import free_port
from services.config import EngineConfig
from services.embeddings.lru import EmbeddingLRU
from services.embeddings.store import EmbeddingStoreConfig
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.models.info import ModelInfo
from services.sampling_params import SamplingParams
from services.tokenization import load_tokenizer
from tests.helpers.tower import Tower, png


@pytest.fixture
def engine_config(llava_ckpt) -> EngineConfig:
    return EngineConfig(model=str(llava_ckpt), block_size=4, num_kv_blocks=128)


@pytest.fixture
def preparer(engine_config, llava_ckpt) -> RequestPreparer:
    info = ModelInfo.load(engine_config)
    return RequestPreparer(info, load_tokenizer(llava_ckpt, torch_free=True), 60.0)


async def _backend(engine_config, store: EmbeddingStoreConfig | None = None) -> AggregatedBackend:
    backend = AggregatedBackend(AsyncEngine(LLMEngine(engine_config)), store=store)
    await backend.start()
    return backend


def _prep(preparer: RequestPreparer, *images: bytes) -> PreparedRequest:
    prompt = "look " + " and ".join("<image>" for _ in images) + " now"
    return preparer.prepare(
        model="", prompt=prompt, images=images, params={"temperature": 0, "max_tokens": 4}
    )


async def _tokens(backend: AggregatedBackend, prep: PreparedRequest) -> list[int]:
    return [t async for ev in backend.generate(prep) for t in ev.token_ids]


def test_lru_evicts_the_least_recently_used_past_its_bytes():
    lru = EmbeddingLRU(max_bytes=3 * 16)  # three [2, 2] float32 tensors
    for key in "abc":
        lru.put(key, torch.zeros(2, 2))
    assert lru.get("a") is not None  # a is now the most recent: b goes first
    lru.put("d", torch.zeros(2, 2))
    assert (lru.get("b"), len(lru), lru.bytes) == (None, 3, 48)
    lru.put("huge", torch.zeros(4, 4))  # larger than the whole budget: not kept
    assert lru.get("huge") is None and len(lru) == 3


async def test_a_repeated_image_skips_the_tower_and_answers_the_same(engine_config, preparer):
    backend = await _backend(engine_config)
    tower = Tower(backend)
    try:
        first = await _tokens(backend, _prep(preparer, png(1)))
        again = await _tokens(backend, _prep(preparer, png(1)))
        other = await _tokens(backend, _prep(preparer, png(2), png(1)))
    finally:
        await backend.stop()
    assert tower.passes == 2  # png(1) once, png(2) once
    # The engine's own path (the tower inside add_request) gives the same tokens.
    llm = LLMEngine(engine_config)
    prep = _prep(preparer, png(1))
    llm.add_request(
        "ref",
        {"prompt_token_ids": prep.prompt_token_ids, "images": prep.images},
        SamplingParams(temperature=0, max_tokens=4),
    )
    ref = []
    while llm.has_unfinished_requests():
        ref = [o.outputs[0].token_ids for o in llm.step() if o.request_id == "ref"] or ref
    assert first == again == list(ref[0]) and len(other) == 4


async def test_concurrent_requests_for_one_image_encode_it_once(engine_config, preparer):
    backend = await _backend(engine_config)
    tower = Tower(backend)
    try:
        outs = await asyncio.gather(*(_tokens(backend, _prep(preparer, png(3))) for _ in range(3)))
    finally:
        await backend.stop()
    assert tower.passes == 1 and outs[0] == outs[1] == outs[2]


async def test_no_redis_is_a_miss_not_a_failure(engine_config, preparer):
    store = EmbeddingStoreConfig(url=f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.2)
    backend = await _backend(engine_config, store)
    tower = Tower(backend)
    try:
        t0 = time.monotonic()
        out = await _tokens(backend, _prep(preparer, png(4)))
        again = await _tokens(backend, _prep(preparer, png(4)))
        took = time.monotonic() - t0
    finally:
        await backend.stop()
    assert len(out) == 4 and out == again and tower.passes == 1
    assert took < 10  # each Redis call gave up within its timeout; nothing waited longer
