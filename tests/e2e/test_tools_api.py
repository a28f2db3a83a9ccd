"""Tool calling and reasoning over the OpenAI API with the official client, against
`epd serve all` (`epd up --aggregated`) and the fleet (`epd up`), on a tiny
random-weight checkpoint with a byte-level BPE tokenizer and a Qwen-style chat
template: every well-formed call is the grammar's doing. Served with
``--tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from tests.helpers.chat_templates import QWEN_TOOLS
from tests.helpers.checkpoints import make_byte_bpe_checkpoint
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow
BYPASS = {"x-epd-cache": "bypass"}
FLAGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK = [{"role": "user", "content": "weather in Paris?"}]


def valid_call(call) -> bool:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        return args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
    return (
        set(args) == {"city", "days"}
        and len(args["city"]) <= 12
        and type(args["days"]) is int
        and 1 <= args["days"] <= 7
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_byte_bpe_checkpoint(tmp_path_factory.mktemp("tools"), chat_template=QWEN_TOOLS)


def _serve(demo_dir, model_dir, *args):
    running = epd_up(demo_dir, "--model", str(model_dir), "--max-model-len", "1024", *FLAGS, *args)
    client = openai.OpenAI(
        base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, default_headers=BYPASS
    )
    return running, client


@pytest.fixture(scope="module")
def served(demo_dir, model_dir):
    running, client = _serve(demo_dir, model_dir, "--aggregated", "--reasoning-parser", "qwen3")
    yield running, client
    output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served[1]


def _chat(client, **kw):
    kw.setdefault("max_tokens", 120)
    kw.setdefault("messages", ASK)
    kw.setdefault("extra_body", {"chat_template_kwargs": {"enable_thinking": False}})
    return client.chat.completions.create(model=client.models.list().data[0].id, **kw)


def test_required_calls_valid_tools(client):
    out = _chat(client, tools=TOOLS, tool_choice="required", temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and all(valid_call(c) for c in choice.message.tool_calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    sampled = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=2)
    for c in sampled.choices:
        assert c.finish_reason == "tool_calls" and all(valid_call(t) for t in c.message.tool_calls)


def test_named_tool_is_called_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        out = _chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_time" and valid_call(call)
        assert out.choices[0].finish_reason == "stop"  # OpenAI's, for a forced function


def test_none_and_auto_answer_in_text(client):
    none = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None
    auto = _chat(client, tools=TOOLS, max_tokens=16, temperature=0)  # auto is the default
    message = auto.choices[0].message
    assert message.tool_calls is None or all(valid_call(c) for c in message.tool_calls)


def test_streamed_tool_calls_follow_openai_deltas(client):
    stream = _chat(client, tools=TOOLS, tool_choice="required", stream=True, temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # id and name come first, once
                assert d.id and d.function.name
                calls[d.index] = {"name": d.function.name, "args": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        fake = type(
            "C", (), {"function": type("F", (), {"name": call["name"], "arguments": call["args"]})}
        )
        assert valid_call(fake), call


def test_a_tool_result_round_trip(client):
    first = _chat(client, tools=TOOLS, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    out = _chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=6)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > first.usage.prompt_tokens  # the result was rendered


def test_tokenize_renders_tools_and_template_keywords(served):
    running, client = served
    body = {"model": client.models.list().data[0].id, "messages": ASK}
    url = f"{running.base_url}/tokenize"
    plain = httpx.post(url, json=body).json()["count"]
    tools = httpx.post(url, json={**body, "tools": TOOLS}).json()["count"]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    off = httpx.post(url, json={**body, **kwargs}).json()["count"]
    assert tools > plain and off != plain


def test_reasoning_is_split_and_bounded(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    out = _chat(
        client,
        response_format=fmt,
        temperature=0,
        extra_body={"thinking_token_budget": 6},
    )
    message = out.choices[0].message
    assert message.reasoning and message.reasoning_content == message.reasoning
    assert set(json.loads(message.content)) == {"city", "days"}  # the grammar after thinking
    off = _chat(client, response_format=fmt, temperature=0)  # enable_thinking false
    assert getattr(off.choices[0].message, "reasoning", None) is None
    assert set(json.loads(off.choices[0].message.content)) == {"city", "days"}


def test_a_thinking_model_calls_tools_after_its_thinking(client):
    out = _chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        extra_body={"thinking_token_budget": 4},
    )
    message = out.choices[0].message
    assert message.reasoning and out.choices[0].finish_reason == "tool_calls"
    assert all(valid_call(c) for c in message.tool_calls)


def test_streamed_reasoning_goes_to_its_own_deltas(client):
    stream = _chat(client, stream=True, temperature=0, extra_body={"thinking_token_budget": 5})
    thinking = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        thinking += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
    assert thinking and "</think>" not in thinking + content


def test_grpc_takes_tools_and_answers_with_calls(served):
    running, client = served
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="user", content="weather in Paris?")],
        tools=[
            pb.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"]))
            for t in TOOLS
        ],
        tool_choice="get_weather",
        chat_template_kwargs=json.dumps({"enable_thinking": False}),
    )
    req = pb.GenerateRequest(
        model=client.models.list().data[0].id,
        chat=chat,
        sampling=pb.SamplingParams(temperature=0, max_tokens=120),
    )
    with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as ch:
        stub = pbg.InferenceStub(ch)
        out = stub.GenerateOnce(req, timeout=60)
        (call,) = out.answer.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.arguments)) == {"city", "days"}
        last = list(stub.Generate(req, timeout=60))[-1]
        assert [c.arguments for c in last.answer.tool_calls] == [call.arguments]
        req.chat.tool_choice = "nope"
        with pytest.raises(grpc.RpcError) as bad:
            stub.GenerateOnce(req, timeout=60)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        req.chat.tool_choice = "required"
        req.chat.tools[0].parameters = "{not json"
        with pytest.raises(grpc.RpcError) as bad:
            stub.GenerateOnce(req, timeout=60)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_mixed_batch_of_16_concurrent_requests(client):
    """Tool choices, a schema, a regex, a choice and free text at once: each answer
    keeps its own constraint."""
    named = {"type": "function", "function": {"name": "get_time"}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    asks = [
        ("required", {"tools": TOOLS, "tool_choice": "required"}),
        ("named", {"tools": TOOLS, "tool_choice": named}),
        ("json", {"response_format": fmt}),
        ("regex", {"extra_body": {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}}),
        ("choice", {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}),
        ("free", {"max_tokens": 8}),
    ]
    jobs = [asks[i % len(asks)] for i in range(16)]

    def one(job):
        kind, kw = job
        extra = {**kw.pop("extra_body", {}), "chat_template_kwargs": {"enable_thinking": False}}
        return kind, _chat(client, temperature=0.8, seed=len(kind), extra_body=extra, **kw)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, [(k, dict(kw)) for k, kw in jobs]))
    for kind, out in results:
        message = out.choices[0].message
        if kind in ("required", "named"):
            assert message.tool_calls and all(valid_call(c) for c in message.tool_calls)
            assert kind == "required" or message.tool_calls[0].function.name == "get_time"
        elif kind == "json":
            assert set(json.loads(message.content)) == {"city", "days"}
        elif kind == "regex":
            assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", message.content.strip())
        elif kind == "choice":
            assert message.content.strip() in ("yes", "no")


def test_models_list_tool_calling_and_reasoning(client):
    (card,) = client.models.list().data
    assert card.tool_calling == {
        "parser": "hermes",
        "tool_choice": ["none", "required", "function", "auto"],
    }
    assert card.reasoning == "qwen3"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "x"}}, "tool_choice"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(served, extra, param):
    running, client = served
    body = {"model": client.models.list().data[0].id, "messages": ASK, "max_tokens": 4, **extra}
    resp = httpx.post(f"{running.base_url}/v1/chat/completions", json=body, headers=BYPASS)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_the_fleet_calls_tools_and_streams_them(demo_dir, model_dir):
    running, client = _serve(demo_dir, model_dir)
    try:
        out = _chat(client, tools=TOOLS, tool_choice="required", temperature=0)
        assert out.choices[0].finish_reason == "tool_calls"
        assert all(valid_call(c) for c in out.choices[0].message.tool_calls)
        stream = _chat(client, tools=TOOLS, tool_choice="required", stream=True, temperature=0)
        args = "".join(
            d.function.arguments or ""
            for chunk in stream
            for d in chunk.choices[0].delta.tool_calls or []
        )
        assert json.loads(args) == json.loads(
            out.choices[0].message.tool_calls[0].function.arguments
        )
    finally:
        output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]
