"""`serve all` shares the fleet's Redis embedding cache: same keys, same values."""

from __future__ import annotations

import pytest
import torch

from gateway.aggregated import AggregatedBackend
from gateway.prepare import PreparedRequest, RequestPreparer
from services.config import EngineConfig
from services.embeddings.keys import embedding_key
from services.embeddings.store import EmbeddingStoreConfig, pack_embedding
from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import LLMEngine
from services.models.info import ModelInfo
from services.tokenization import load_tokenizer
from tests.helpers.checkpoints import make_llava_checkpoint
from tests.helpers.tower import Tower, png


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    ckpt = make_llava_checkpoint(tmp_path_factory.mktemp("llava"))
    return EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128)


@pytest.fixture(scope="module")
def preparer(engine_config) -> RequestPreparer:
    info = ModelInfo.load(engine_config)
    return RequestPreparer(info, load_tokenizer(engine_config.model, torch_free=True), 60.0)


def _prep(preparer: RequestPreparer, image: bytes) -> PreparedRequest:
    return preparer.prepare(
        model="",
        prompt="look <image> now",
        images=[image],
        params={"temperature": 0, "max_tokens": 4},
    )


async def _tokens(backend: AggregatedBackend, prep: PreparedRequest) -> list[int]:
    return [t async for ev in backend.generate(prep) for t in ev.token_ids]


async def test_a_second_server_reads_the_first_ones_embedding(
    engine_config, preparer, redis_server, redis_client
):
    """Two aggregated servers (fresh LRUs) on one Redis: the second runs no tower pass,
    and the value sits under the fleet's key, in the fleet's format."""
    engine = AsyncEngine(LLMEngine(engine_config))
    store = EmbeddingStoreConfig(url=redis_server.url)
    first, second = AggregatedBackend(engine, store=store), AggregatedBackend(engine, store=store)
    towers = Tower(first), Tower(second)
    await first.start()
    try:
        prep = _prep(preparer, png(11))
        a = await _tokens(first, prep)
        b = await _tokens(second, _prep(preparer, png(11)))
        key = embedding_key(engine.engine.loaded.fingerprint, prep.spans[0].image_hash)
        value = await redis_client.get(key)
        emb = first.images.lru.get(prep.spans[0].image_hash)
    finally:
        await first.stop()
        await second.stop()
    assert (towers[0].passes, towers[1].passes) == (1, 0)
    assert a == b and len(a) == 4
    assert value == pack_embedding(emb)


async def test_a_wrong_value_in_redis_is_encoded_again(
    engine_config, preparer, redis_server, redis_client
):
    engine = AsyncEngine(LLMEngine(engine_config))
    backend = AggregatedBackend(engine, store=EmbeddingStoreConfig(url=redis_server.url))
    tower = Tower(backend)
    prep = _prep(preparer, png(12))
    key = embedding_key(engine.engine.loaded.fingerprint, prep.spans[0].image_hash)
    await redis_client.set(key, pack_embedding(torch.zeros(3, 5)))  # not this model's shape
    await backend.start()
    try:
        out = await _tokens(backend, prep)
        stored = await redis_client.get(key)
    finally:
        await backend.stop()
    assert tower.passes == 1 and len(out) == 4
    assert stored == pack_embedding(backend.images.lru.get(prep.spans[0].image_hash))
