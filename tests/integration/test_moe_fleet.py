"""Qwen3-MoE, Mixtral and Nemotron-H through the E/P/D fleet and `serve all` over real
NATS and Redis, called over gRPC with prompt token ids: token-identical to transformers
(prefill on one instance, decode on another after the KV hand-off; Nemotron-H's Mamba
state goes with its KV, and a decode that started from any other state would drift)."""

from __future__ import annotations

import random

import pytest
import pytest_asyncio

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from tests.helpers.checkpoints import MOE_ARCHS, make_text_checkpoint
from tests.helpers.reference import hf_greedy, load_hf
from tests.integration.stack import start_fleet_and_serve_all

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_NEW = 10
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(1000, 30000) for _ in range(n)] for n in (7, 40, 90)]


@pytest.fixture(scope="module", params=(*MOE_ARCHS, "nemotron_h"))
def ckpt(request, tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(ckpt, nats_server, redis_server):
    engine = EngineConfig(model=str(ckpt), block_size=16, num_kv_blocks=256)
    stacks = await start_fleet_and_serve_all(engine, nats_server.url, redis_server.url, "moe")
    yield stacks
    for stack in stacks:
        await stack.stop()


async def test_fleet_and_serve_all_match_transformers(stacks, ckpt):
    hf = load_hf(ckpt)
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompt in PROMPTS:
        want, _ = hf_greedy(hf, prompt, MAX_NEW)
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp)
        for stack in stacks:
            assert list((await stack.stub.GenerateOnce(req, timeout=120)).token_ids) == want
