"""The lean MiniLM forward gives transformers' ``BertModel`` vectors, one question or a
padded batch: within 1e-5 in float32 (what the semantic cache's accuracy figures may move
by: none); in bfloat16, every cosine of the labelled pairs within 2.5e-3 of ``BertModel``'s
(what that does to the accuracy figures: docs/semantic-cache.md)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_svc.embedder import MAX_TOKENS, SentenceBatcher, SentenceEmbedder
from services.kernels.cpu_head import has_native_bf16

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder(dtype="float32")


@pytest.fixture(scope="module")
def bf16() -> SentenceEmbedder:
    import torch

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2-only hosts
        pytest.skip("oneDNN's bf16 linear needs AVX512BW/VL/DQ or AVX_NE_CONVERT")
    return SentenceEmbedder(dtype="bfloat16")


def _questions(n: int) -> list[str]:
    rows = [
        json.loads(line)
        for line in (DATA / "semantic_cache_pairs.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [q for r in rows[: n // 2] for q in (r["a"], r["b"])]


@torch.inference_mode()
def _reference(embedder: SentenceEmbedder, texts: list[str]) -> np.ndarray:
    """The sentence-transformers recipe over transformers' own BertModel forward."""
    batch = embedder.tokenizer(
        texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
    )
    hidden = embedder.model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_one_question_at_a_time_matches_bert(embedder):
    for text in _questions(16):
        assert np.abs(embedder([text]) - _reference(embedder, [text])).max() < 1e-5


def test_a_padded_batch_matches_bert(embedder):
    texts = _questions(48) + ["a much longer question " * 12 + "about nothing in particular?"]
    ours, ref = embedder(texts), _reference(embedder, texts)
    assert ours.shape == (len(texts), 384)
    assert np.abs(ours - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_bf16_cosines_of_the_labelled_pairs_stay_within_their_bound(bf16):
    rows = [
        json.loads(line)
        for line in (DATA / "semantic_cache_pairs.jsonl").read_text().splitlines()
        if line.strip()
    ]
    a, b = [r["a"] for r in rows], [r["b"] for r in rows]
    ours = (bf16(a) * bf16(b)).sum(1)
    ref = (_reference(bf16, a) * _reference(bf16, b)).sum(1)
    assert np.abs(ours - ref).max() < 2.5e-3
    assert np.allclose(np.linalg.norm(bf16(a[:8]), axis=1), 1.0, atol=1e-5)


def test_a_padded_bf16_batch_gives_each_question_its_own_vector(bf16):
    texts = _questions(16) + ["a much longer question " * 12 + "about nothing in particular?"]
    alone = np.concatenate([bf16([t]) for t in texts])
    assert np.abs(bf16(texts) - alone).max() < 2e-3


def test_auto_takes_bf16_exactly_where_the_cpu_has_bf16_dot_products():
    assert SentenceEmbedder().dtype == ("bfloat16" if has_native_bf16() else "float32")
    with pytest.raises(ValueError, match="dtype"):
        SentenceEmbedder(dtype="float16")


async def test_a_recent_question_is_not_embedded_again(embedder):
    """The lookup of a miss embeds its question; the store of its answer reuses that."""
    calls: list[list[str]] = []

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(texts)
        return embedder(texts)

    batcher = SentenceBatcher(counting, recent=2)
    first = await batcher.embed("how tall is the eiffel tower?")
    again = await batcher.embed("how tall is the eiffel tower?")
    assert len(calls) == 1 and np.array_equal(first, again)
    await batcher.embed("b?")
    await batcher.embed("c?")  # past the bound: the first question is forgotten
    await batcher.embed("how tall is the eiffel tower?")
    assert len(calls) == 4


async def test_a_prefetch_and_the_lookups_after_it_share_one_pass(embedder):
    """An exact miss starts its question's embedding; the full lookup that follows (and
    any other waiting for the same text) awaits that pass, and a waiter that gives up
    does not cancel it for the others."""
    calls: list[list[str]] = []
    gate = threading.Event()

    def gated(texts: list[str]) -> np.ndarray:
        calls.append(texts)
        gate.wait(10)
        return embedder(texts)

    batcher = SentenceBatcher(gated)
    batcher.prefetch("how tall is the eiffel tower?")
    await asyncio.sleep(0.05)  # the pass is running in its thread
    quitter = asyncio.ensure_future(batcher.embed("how tall is the eiffel tower?"))
    waiter = asyncio.ensure_future(batcher.embed("how tall is the eiffel tower?"))
    await asyncio.sleep(0.01)
    quitter.cancel()
    gate.set()
    vec = await waiter
    assert calls == [["how tall is the eiffel tower?"]]
    assert np.array_equal(vec, embedder(["how tall is the eiffel tower?"])[0])
    batcher.prefetch("how tall is the eiffel tower?")  # known: nothing to do
    assert await batcher.embed("how tall is the eiffel tower?") is vec and len(calls) == 1
    assert not batcher._inflight


async def test_a_failed_prefetch_fails_its_waiters_and_is_forgotten(embedder):
    def broken(texts: list[str]) -> np.ndarray:
        raise RuntimeError("no model")

    batcher = SentenceBatcher(broken)
    batcher.prefetch("q?")
    with pytest.raises(RuntimeError, match="no model"):
        await batcher.embed("q?")
    batcher.prefetch("r?")  # nobody awaits it: the error is read, not logged as lost
    await asyncio.sleep(0.05)
    assert not batcher._inflight
