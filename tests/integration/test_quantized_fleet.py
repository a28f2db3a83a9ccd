"""Quantized weights and a quantized KV cache (int8, fp8) through the E/P/D fleet and
`serve all` over real NATS and Redis: token-identical to the offline engine with the
same settings. In the fleet the prefill instance quantizes the prompt's KV and the
decode instance reads those blocks as they arrive: the scales travel inside the rows
(services/kernels/kv_quant.py), and a decode that re-quantized or lost them would drift
from the offline tokens."""

from __future__ import annotations

import random

import pytest
import pytest_asyncio

from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.integration.stack import start_fleet_and_serve_all

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_NEW = 12
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(10, 900) for _ in range(n)] for n in (5, 37, 80)]
SETTINGS = {"quantization": "int8", "block_size": 16, "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("quant-fleet"), "llama")


@pytest.fixture(scope="module", params=["int8", "fp8"])
def settings(request):
    return SETTINGS | {"kv_cache_dtype": request.param}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(ckpt, settings, nats_server, redis_server):
    engine = EngineConfig(model=str(ckpt), **settings)
    stacks = await start_fleet_and_serve_all(engine, nats_server.url, redis_server.url, "quant")
    yield stacks
    for stack in stacks:
        await stack.stop()


async def test_fleet_and_serve_all_match_the_offline_engine(stacks, ckpt, settings):
    offline = LLM(str(ckpt), **settings)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    wants = [
        o.outputs[0].token_ids
        for o in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    fleet = stacks[0]
    before = sum(d.adopted for d in fleet.decodes)
    for prompt, want in zip(PROMPTS, wants, strict=True):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp)
        for stack in stacks:
            assert list((await stack.stub.GenerateOnce(req, timeout=120)).token_ids) == want
    assert sum(d.adopted for d in fleet.decodes) == before + len(PROMPTS)  # every one handed off
    wire = {"int8": "int8", "fp8": "uint8"}[settings["kv_cache_dtype"]]
    assert fleet.decodes[0].receiver.expected[-1] == wire
