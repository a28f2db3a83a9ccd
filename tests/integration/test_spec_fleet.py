"""Speculative decoding in the fleet: decode instances started with an n-gram
speculative config return the same greedy tokens, over real NATS and Redis, as the
aggregated engine without speculation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
import torch

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.engine.spec.decoding import SpecDecoding
from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.spec_proposers import RecordingProposer
from tests.integration.stack import start_aggregated, start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


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
    spec = dataclasses.replace(engine_config, speculative_config=NGRAM)
    disagg = await start_disaggregated(spec, nats_server.url, redis_server.url, "spec")
    agg = await start_aggregated(engine_config, nats_server.url, redis_server.url, "spec")
    yield disagg, agg
    await disagg.stop()
    await agg.stop()


def request(text: str, max_tokens: int = 24) -> pb.GenerateRequest:
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=text)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return pb.GenerateRequest(model="demo", chat=pb.Chat(messages=[msg]), sampling=sp)


async def collect(stub, req) -> tuple[list[int], int]:
    ids, finish = [], 0
    async for resp in stub.Generate(req):
        ids += list(resp.token_ids)
        finish = resp.finish_reason or finish
    return ids, finish


async def test_disaggregated_ngram_speculation_returns_the_same_tokens(stacks):
    disagg, agg = stacks
    # Repetitive prompts: prompt lookup finds drafts in them.
    texts = [" ".join(["red green blue"] * (i + 2)) + f" then {i}" for i in range(6)]
    texts += [f"count: {' '.join(str(j) for j in range(i, i + 12))}" for i in range(4)]
    reqs = [request(t) for t in texts]
    ours = await asyncio.gather(*(collect(disagg.stub, r) for r in reqs))
    ref = await asyncio.gather(*(collect(agg.stub, r) for r in reqs))
    assert ours == ref
    assert sum(d.adopted for d in disagg.decodes) > 0  # KV handed over by prefill
    stats = [d.engine.engine.spec.stats for d in disagg.decodes]
    assert sum(s.draft_tokens for s in stats) > 0


async def test_prefill_hands_the_draft_head_its_last_prompt_row(stacks, engine_config):
    """With a draft head that wants layer outputs, the prefill instance sends the row of
    the last prompt position with the KV; the decode instance hands it to the head
    before any row it computes itself, and it equals the row computed in one engine."""
    disagg, _ = stacks
    layers = (1, 0)
    disagg.prefill.engine.engine.runner.aux_layers = layers  # the head's request
    recorders = []
    for d in disagg.decodes:
        eng = d.engine.engine
        recorders.append(RecordingProposer(layers))
        eng.spec = SpecDecoding.build(
            eng.config.speculative_config, eng.loaded, eng.runner, recorders[-1]
        )
    before = sum(d.adopted for d in disagg.decodes)
    texts = [f"tell me about the number {i} and its friends" for i in range(3)]
    await asyncio.gather(*(collect(disagg.stub, request(t, 6)) for t in texts))
    assert sum(d.adopted for d in disagg.decodes) > before
    firsts = {}
    for rec in recorders:
        for rid, first, rows, tokens in rec.rows:
            firsts.setdefault(rid, (first, rows, tokens))
    # Requests prefilled elsewhere: their first rows start at the last prompt position
    # (the row that travelled), not at 0.
    imported = [(f, r, t) for f, r, t in firsts.values() if f > 0]
    assert imported
    one = LLM(
        engine_config.model,
        demo_dir=engine_config.demo_dir,
        device="cpu",
        num_kv_blocks=64,
        speculative_config=NGRAM,
    )
    rec = RecordingProposer(layers)
    one.engine.spec = SpecDecoding.build(
        one.engine.config.speculative_config, one.engine.loaded, one.engine.runner, rec
    )
    for first, rows, tokens in imported:
        rec.rows.clear()
        one.generate({"prompt_token_ids": tokens[: first + 1]}, SamplingParams(max_tokens=3))
        _, start, want, _ = rec.rows[0]
        assert start == 0 and want.shape[0] == first + 1
        torch.testing.assert_close(rows[:1], want[-1:], atol=1e-4, rtol=1e-4)
