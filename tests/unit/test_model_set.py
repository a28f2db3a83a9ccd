"""ModelSet.resolve, the one place a request's ``model`` becomes the core that answers:
a concrete name or "" (the default), a virtual name through the semantic router's hook,
404 for an unknown name and 503 for a model whose instances are all gone; the REST app
and the gRPC servicer over two models of different architectures (no servers: the
backends only say whether their model has live instances)."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from gateway.core import GatewayCore
from gateway.errors import classify
from gateway.grpc_server import InferenceServicer
from gateway.models import ModelRequest, ModelSet, ModelUnavailable, UnknownModel
from gateway.prepare import RequestPreparer
from gateway.rest.app import build_app
from protos.epd_pb import inference_pb2 as pb
from services.config import EngineConfig
from services.models.info import ModelInfo
from services.tokenization import load_tokenizer
from tests.helpers.checkpoints import make_text_checkpoint


class FleetState:
    """A backend that only answers whether its model has live instances (what
    resolve and /v1/models read); it runs nothing."""

    def __init__(self, live: bool = True):
        self.live = live

    def serving(self) -> bool:
        return self.live

    def ready(self) -> bool:
        return self.live


def _core(path: Path, live: bool = True) -> GatewayCore:
    info = ModelInfo.load(EngineConfig(model=str(path)))
    preparer = RequestPreparer(info, load_tokenizer(path, torch_free=True), 60.0)
    return GatewayCore(preparer, FleetState(live))


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return make_text_checkpoint(root, "llama"), make_text_checkpoint(root, "qwen2")


@pytest.fixture
def models(paths) -> ModelSet:
    return ModelSet([_core(paths[0]), _core(paths[1])])


def test_names_resolve_to_their_own_core(models: ModelSet):
    llama, qwen = models.names
    assert (llama, qwen) == ("llama-0", "qwen2-0")
    assert models.resolve(llama).info.architectures == ["LlamaForCausalLM"]
    assert models.resolve(qwen).info.architectures == ["Qwen2ForCausalLM"]
    assert models.resolve("") is models.default is models.resolve(llama)


def test_unknown_is_404_and_unavailable_is_503(models: ModelSet):
    with pytest.raises(UnknownModel) as unknown:
        models.resolve("gpt-4")
    failure = classify(unknown.value)
    assert (failure.code, failure.http_status) == ("NOT_FOUND", 404)
    assert failure.openai_body()["error"]["code"] == "model_not_found"
    models.resolve("qwen2-0").backend.live = False
    with pytest.raises(ModelUnavailable) as gone:
        models.resolve("qwen2-0")
    failure = classify(gone.value)
    assert (failure.code, failure.http_status) == ("UNAVAILABLE", 503)
    assert models.lookup("qwen2-0").info.model_id == "qwen2-0"  # tokenize still works
    assert [c.info.model_id for c in models.live()] == ["llama-0"]
    assert models.ready()


def test_virtual_names_go_through_the_hook(models: ModelSet):
    seen = []

    def route(name: str, request: ModelRequest | None) -> str | None:
        seen.append((name, request.messages if request else None))
        return "qwen2-0" if name == "auto" else None

    models.virtual = route
    messages = [{"role": "user", "content": "hi"}]
    assert models.resolve("auto", ModelRequest(messages=messages)).info.model_id == "qwen2-0"
    assert models.resolve("llama-0").info.model_id == "llama-0"  # concrete: no hook
    assert seen == [("auto", messages)]
    with pytest.raises(UnknownModel):
        models.resolve("nobody")


async def test_prepare_tokenizes_with_the_resolved_model(models: ModelSet):
    messages = [{"role": "user", "content": "hello there"}]
    for name in models.names:
        core, prep = await models.prepare(model=name, params={"max_tokens": 4}, messages=messages)
        assert core.info.model_id == name
        expected = core.tokenizer.encode(
            core.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        assert prep.prompt_token_ids == expected


async def test_the_inflight_limit_counts_every_model(paths):
    from gateway.config import GatewayConfig
    from gateway.events import BackendError

    cores = [_core(p) for p in paths]
    for core in cores:
        core.config = GatewayConfig(max_inflight=3)
    models = ModelSet(cores)
    cores[0].inflight, cores[1].inflight = 2, 1  # each under the limit, together at it
    with pytest.raises(BackendError) as full:
        await models.prepare(model="qwen2-0", params={}, prompt="hi")
    assert full.value.code == "RESOURCE_EXHAUSTED"
    cores[0].inflight = 1
    core, _ = await models.prepare(model="qwen2-0", params={"max_tokens": 2}, prompt="hi")
    assert core is cores[1]


def test_duplicate_names_are_refused(paths):
    with pytest.raises(ValueError, match="given twice"):
        ModelSet([_core(paths[0]), _core(paths[0])])


async def test_rest_lists_live_models_and_answers_404_and_503(models: ModelSet):
    transport = httpx.ASGITransport(app=build_app(models))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["llama-0", "qwen2-0"]
        models.lookup("qwen2-0").backend.live = False
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["llama-0"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        gone = await client.post("/v1/chat/completions", json={**body, "model": "qwen2-0"})
        assert gone.status_code == 503
        assert gone.json()["error"]["type"] == "server_error"
        unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        tok = await client.post("/tokenize", json={"model": "qwen2-0", "prompt": "hello"})
        assert tok.status_code == 200  # the tokenizer needs no instance
        assert (await client.get("/v1/models/qwen2-0")).status_code == 200
        assert (await client.get("/v1/models/nope")).status_code == 404
        assert (await client.get("/health")).status_code == 200


class _Aborted(Exception):
    pass


class _Context:
    """The part of a grpc.aio context the servicer uses before any model runs."""

    def __init__(self):
        self.code = None

    def invocation_metadata(self):
        return ()

    async def abort(self, code, message):
        self.code = code
        raise _Aborted(message)

    def time_remaining(self):
        return None


async def test_grpc_list_models_and_status_codes(models: ModelSet):
    servicer = InferenceServicer(models)
    listed = await servicer.ListModels(pb.ListModelsRequest(), _Context())
    assert [m.id for m in listed.models] == ["llama-0", "qwen2-0"]
    models.lookup("llama-0").backend.live = False
    listed = await servicer.ListModels(pb.ListModelsRequest(), _Context())
    assert [m.id for m in listed.models] == ["qwen2-0"]
    for name, code in (("llama-0", grpc.StatusCode.UNAVAILABLE), ("x", grpc.StatusCode.NOT_FOUND)):
        ctx = _Context()
        with pytest.raises(_Aborted):
            await servicer.GenerateOnce(pb.GenerateRequest(model=name, prompt="hi"), ctx)
        assert ctx.code == code
