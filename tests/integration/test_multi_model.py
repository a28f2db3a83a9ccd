"""Two models of different architectures (Llama, Qwen2) on one fleet, real NATS and Redis.

One gateway serves both (``Gateway(models=[...])``, as ``epd serve gateway --model A
--model B``). Llama's prefill and decode run in this process (their counters show which
instance answered); Qwen2's run as ``epd serve`` processes, so they can be killed with
SIGKILL (their own /metrics show what they did). Each request lands on its model's
instances only and its tokens equal the same prompt run on that model alone; /v1/models
lists both; with every Qwen2 instance killed, Llama still serves, Qwen2 answers 503 /
UNAVAILABLE, and an unknown model 404 / NOT_FOUND.
"""

from __future__ import annotations

import dataclasses
import re

import grpc
import httpx
import pytest
import pytest_asyncio

from decode_svc.service import DecodeService
from gateway.app import Gateway
from gateway.config import GatewayConfig
from launch.localstack import free_port
from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services import LLM, SamplingParams
from services.bus import subjects
from services.config import EngineConfig, ServiceConfig
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.fleet import ProcessFleet, Worker, fail_message, text_fleet_env
from tests.integration.stack import NO_CACHE, service_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TOKENS = 10
PROMPTS = [[5, 17, 23, 42, 8, 99, 3], [64, 12, 7, 7, 30], [11, 2, 90, 45, 61, 18, 27, 33, 6]]


class MultiModelFleet:
    """Llama in this process, Qwen2 in child processes, one gateway for both."""

    def __init__(self, llama: str, qwen: str, procs: ProcessFleet):
        self.llama, self.qwen, self.procs = llama, qwen, procs
        self.llama_services: list = []
        self.qwen_decode: Worker | None = None
        self.qwen_metrics = 0
        self.gateway: Gateway | None = None
        self.channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> pbg.InferenceStub:
        return pbg.InferenceStub(self.channel)

    @property
    def llama_decode(self) -> DecodeService:
        return self.llama_services[1]

    async def qwen_generated(self) -> float:
        """Tokens the Qwen2 decode process has sampled (its own /metrics). Asynchronous:
        the in-process services must keep beating meanwhile."""
        url = f"http://127.0.0.1:{self.qwen_metrics}/metrics"
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(url)).text
        found = re.search(r"^epd_engine_generated_tokens_total (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return str(make_text_checkpoint(root, "llama")), str(make_text_checkpoint(root, "qwen2"))


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens on each model alone (the offline engine)."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = {}
    for path in checkpoints:
        llm = LLM(model=path, num_kv_blocks=64)
        runs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        out[path] = [list(r.outputs[0].token_ids) for r in runs]
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints, nats_server, redis_server, tmp_path_factory):
    llama, qwen = checkpoints
    env = text_fleet_env(qwen, num_kv_blocks=128)
    procs = ProcessFleet(
        qwen, nats_server.url, redis_server.url, tmp_path_factory.mktemp("logs"), env
    )
    f = MultiModelFleet(llama, qwen, procs)
    f.qwen_metrics = free_port()
    procs.spawn(subjects.ROLE_PREFILL, "mm-qwen-prefill")
    f.qwen_decode = procs.spawn(
        subjects.ROLE_DECODE, "mm-qwen-decode", EPD_METRICS_PORT=str(f.qwen_metrics)
    )
    engine = EngineConfig(model=llama, num_kv_blocks=128)

    def cfg(name: str) -> ServiceConfig:
        # The services' default beat (1 s) and expiry (3 s): the in-process ones share
        # this event loop, and a busy machine must not read a late beat as a death.
        c = service_config(nats_server.url, redis_server.url, name)
        return dataclasses.replace(c, heartbeat_s=1.0, instance_ttl_s=3.0)

    f.llama_services = [
        PrefillService(engine, cfg("mm-llama-prefill")),
        DecodeService(engine, cfg("mm-llama-decode")),
    ]
    try:
        for svc in f.llama_services:
            await svc.start()
        f.gateway = Gateway(
            engine,
            cfg("mm-gateway"),
            aggregated=False,
            api=GatewayConfig(http_port=0),
            cache=NO_CACHE,
            models=[llama, qwen],
        )
        await f.gateway.start()
        models = f.gateway.models
        try:
            await f.gateway.link.registry.wait_for(
                lambda: all(core.backend.ready() for core in models), timeout_s=180
            )
        except Exception:
            pytest.fail(f"the fleet never came up:\n{fail_message(procs)}")
        f.channel = grpc.aio.insecure_channel(f"127.0.0.1:{f.gateway.grpc_port}")
        yield f
    finally:
        if f.channel is not None:
            await f.channel.close()
        if f.gateway is not None:
            await f.gateway.stop()
        for svc in f.llama_services:
            await svc.stop()
        procs.stop()


def _request(model: str, prompt: list[int]) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return pb.GenerateRequest(model=model, prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp)


def _names(fleet: MultiModelFleet) -> tuple[str, str]:
    return fleet.gateway.models.names[0], fleet.gateway.models.names[1]


async def test_each_request_lands_on_its_model(fleet: MultiModelFleet, reference):
    llama, qwen = _names(fleet)
    assert (llama, qwen) == ("llama-0", "qwen2-0")
    for model, path in ((llama, fleet.llama), (qwen, fleet.qwen)):
        for prompt, want in zip(PROMPTS, reference[path], strict=True):
            adopted, qwen_tokens = fleet.llama_decode.adopted, await fleet.qwen_generated()
            out = await fleet.stub.GenerateOnce(_request(model, prompt), timeout=120)
            assert out.model == model
            assert list(out.token_ids) == want, (model, prompt)
            # The answering instance is the model's own decode instance, never the other's.
            if model == llama:
                assert fleet.llama_decode.adopted == adopted + 1
                assert await fleet.qwen_generated() == qwen_tokens
            else:
                assert fleet.llama_decode.adopted == adopted
                assert await fleet.qwen_generated() >= qwen_tokens + TOKENS - 1
    # The two models really differ here: the same prompt, other tokens.
    assert reference[fleet.llama] != reference[fleet.qwen]


async def test_models_are_listed_over_rest_and_grpc(fleet: MultiModelFleet):
    listed = await fleet.stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert [m.id for m in listed.models] == list(_names(fleet))
    base = f"http://127.0.0.1:{fleet.gateway.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == list(_names(fleet))
        # The dashboard names every instance's model (not its fingerprint).
        state = (await client.get("/dashboard/api/state")).json()
        models = {(r["role"], r["model"]) for r in state["instances"] if r["role"] != "gateway"}
        assert models == {(role, m) for role in ("prefill", "decode") for m in _names(fleet)}
        unknown = await client.post(
            "/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.stub.GenerateOnce(_request("no-such-model", PROMPTS[0]), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_killing_one_model_leaves_the_other_serving(fleet: MultiModelFleet, reference):
    """Last in this module: it kills every Qwen2 instance (SIGKILL, no goodbye)."""
    llama, qwen = _names(fleet)
    for worker in fleet.procs.workers:
        worker.kill()
    qwen_core = fleet.gateway.models.lookup(qwen)
    await fleet.gateway.link.registry.wait_for(lambda: not qwen_core.backend.serving(), 30)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.stub.GenerateOnce(_request(qwen, PROMPTS[0]), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    base = f"http://127.0.0.1:{fleet.gateway.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == [llama]
        gone = await client.post("/v1/completions", json={"model": qwen, "prompt": "hi"})
        assert gone.status_code == 503
        assert gone.json()["error"]["type"] == "server_error"
        assert (await client.get("/health")).status_code == 200  # llama still serves
    out = await fleet.stub.GenerateOnce(_request(llama, PROMPTS[1]), timeout=120)
    assert list(out.token_ids) == reference[fleet.llama][1]
