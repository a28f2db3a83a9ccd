"""The OpenAI REST API as users call it: `epd up` (the whole fleet, NATS at its default
1 MiB max_payload) driven by the official `openai` client, sync and async, and by raw
HTTP where the client hides what is checked (SSE framing, malformed bodies)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.helpers.checkpoints import random_image
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow
KEY = "test-key-2"


def png(seed: int, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png(5))
    return folder


@pytest.fixture(scope="module")
def server(demo_dir, media_dir):
    running = epd_up(
        demo_dir,
        "--max-model-len",
        "256",
        "--api-key",
        "test-key-1",
        "--api-key",
        KEY,
        "--allowed-local-media-path",
        str(media_dir),
        "--allowed-media-domains",
        "127.0.0.1",
        env={"EPD_MAX_BODY_MB": "40"},
    )
    yield running
    output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]


# These tests prove the engine path: the response cache is bypassed (its own test below).
BYPASS = {"x-epd-cache": "bypass"}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, default_headers=BYPASS
    )


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, default_headers=BYPASS
    )


def chat(client, content, max_tokens: int = 12, **kw):
    messages = kw.pop("messages", None) or [{"role": "user", "content": content}]
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="demo", messages=messages, max_tokens=max_tokens, **kw
    )


def post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {**BYPASS, "Authorization": f"Bearer {key}"} if key else dict(BYPASS)
    headers.update(kw.pop("headers", {}))
    if not isinstance(body, bytes | str):
        body, headers["Content-Type"] = json.dumps(body), "application/json"
    return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=120, **kw)


def test_single_and_multi_turn_chat(client):
    one = chat(client, "hello there")
    assert one.object == "chat.completion" and one.id.startswith("chatcmpl-")
    assert one.model == "demo" and one.system_fingerprint.startswith("fp_")
    choice = one.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = one.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens <= 12
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "and then?"},
    ]
    multi = chat(client, None, messages=turns)
    assert multi.usage.prompt_tokens > u.prompt_tokens and multi.choices[0].message.content


def test_string_and_list_content_give_the_same_answer(client):
    text = chat(client, "describe the weather")
    parts = chat(client, [{"type": "text", "text": "describe the weather"}])
    assert text.choices[0].message.content == parts.choices[0].message.content


async def test_streaming_deltas_join_to_the_full_answer(aclient, client, server):
    full = chat(client, "tell me a story", max_tokens=20)
    stream = await aclient.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = post(server, "/v1/chat/completions", body)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")
    events = [
        json.loads(e.removeprefix("data: "))
        for e in raw.text.split("\n\n")
        if e.strip() and e.strip() != "data: [DONE]"
    ]
    keys = ["id", "created", "model", "system_fingerprint", "object", "choices", "usage"]
    assert all(list(e) == keys for e in events) and len({e["id"] for e in events}) == 1
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_usage_matches_the_tokenizer(client, server):
    messages = [{"role": "user", "content": "count these words please"}]
    out = chat(client, None, messages=messages, max_tokens=7, extra_body={"ignore_eos": True})
    tok = post(server, "/tokenize", {"model": "demo", "messages": messages}).json()
    assert out.usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    from transformers import AutoTokenizer

    local = AutoTokenizer.from_pretrained(str(next(server.demo_dir.glob("v*"))))
    text = local.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(local.encode(text, add_special_tokens=False)) == out.usage.prompt_tokens
    detok = post(server, "/detokenize", {"model": "demo", "tokens": tok["tokens"]}).json()
    assert "count these words please" in detok["prompt"]


@pytest.mark.parametrize("top", [0, 5])
def test_logprobs_shapes(client, top):
    out = chat(client, "say something", max_tokens=6, logprobs=True, top_logprobs=top)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and entry.bytes is not None
        assert len(entry.top_logprobs) == top
        if top:
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4


async def test_n_choices_are_distinct_seeded_and_stream_one_finish_each(client, aclient):
    kw = dict(max_tokens=8, temperature=1.0, seed=7, n=3)
    out = chat(client, "name three colours", **kw)
    texts = [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.message.content for c in chat(client, "name three colours", **kw).choices] == texts
    stream = await aclient.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "name three colours"}],
        stream=True,
        **kw,
    )
    seen, finishes, joined = set(), [], {0: "", 1: "", 2: ""}
    async for chunk in stream:
        for c in chunk.choices:
            assert (c.delta.role == "assistant") == (c.index not in seen)
            seen.add(c.index)
            joined[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes.append(c.index)
    assert sorted(finishes) == [0, 1, 2] and [joined[i] for i in range(3)] == texts


def test_stop_strings(client):
    full = chat(client, "say many words", max_tokens=16).choices[0].message.content
    word = full.split()[len(full.split()) // 2]
    out = chat(client, "say many words", max_tokens=16, stop=[word, "zzzz"])
    assert out.choices[0].finish_reason == "stop"
    text = out.choices[0].message.content
    assert word not in text and full.startswith(text)


def test_images_by_data_url_file_url_and_several(client, media_dir):
    one = chat(client, [image_part(data_url(png(5))), {"type": "text", "text": "what?"}])
    from_file = chat(
        client, [image_part(f"file://{media_dir}/cat.png"), {"type": "text", "text": "what?"}]
    )
    assert one.choices[0].message.content == from_file.choices[0].message.content
    assert one.usage.prompt_tokens > 16
    three = chat(
        client,
        [*(image_part(data_url(png(s))) for s in (1, 2, 3)), {"type": "text", "text": "what?"}],
    )
    assert three.usage.prompt_tokens == one.usage.prompt_tokens + 32  # 16 tokens an image


def test_a_20mb_png_through_the_fleet(client):
    arr = np.random.default_rng(0).integers(0, 256, (2600, 2600, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    assert buf.tell() > 20_000_000
    out = chat(client, [image_part(data_url(buf.getvalue())), {"type": "text", "text": "what?"}])
    assert out.choices[0].message.content and out.usage.prompt_tokens > 16


async def test_completions_with_and_without_streaming_and_echo(client, aclient):
    out = client.completions.create(
        model="demo", prompt="once upon a time", max_tokens=8, temperature=0
    )
    assert out.object == "text_completion" and out.choices[0].text
    echoed = client.completions.create(
        model="demo", prompt="once upon a time", max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "once upon a time" + out.choices[0].text
    stream = await aclient.completions.create(
        model="demo", prompt="once upon a time", max_tokens=8, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    for prompts in (["a b c", "d e f"], [[2000, 2001, 2002], [2003, 2004]]):
        many = client.completions.create(
            model="demo", prompt=prompts, max_tokens=4, temperature=0, logprobs=2
        )
        assert [c.index for c in many.choices] == [0, 1]
        assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in many.choices)


def _tiny_huge_png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, format="PNG")  # 81 M pixels, ~80 KB
    return buf.getvalue()


def _chat_body(**kw) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _with_content(content) -> dict:
    return _chat_body(messages=[{"role": "user", "content": content}])


ERRORS = [
    ("stream_options without stream", _chat_body(stream_options={"include_usage": True}), 400),
    ("top_logprobs over 20", _chat_body(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs without logprobs", _chat_body(top_logprobs=2), 400),
    ("n below 1", _chat_body(n=0), 400),
    ("n over the limit", _chat_body(n=17), 400),
    ("seed outside int64", _chat_body(seed=1 << 63), 400),
    ("negative max_tokens", _chat_body(max_tokens=-1), 400),
    ("negative temperature", _chat_body(temperature=-0.5), 400),
    ("too many images", _with_content([image_part(data_url(png(1)))] * 17), 400),
    ("too many pixels", _with_content([image_part(data_url(_tiny_huge_png()))]), 400),
    ("undecodable image", _with_content([image_part(data_url(b"not an image"))]), 400),
    ("scheme not allowed", _with_content([image_part("ftp://example.com/a.png")]), 400),
    ("host not allowed", _with_content([image_part("http://example.com/a.png")]), 400),
    ("loopback address", _with_content([image_part("http://127.0.0.1:9/a.png")]), 400),
    ("file outside the folder", _with_content([image_part("file:///etc/passwd")]), 400),
    ("image_url not an object", _with_content([{"type": "image_url", "image_url": "x"}]), 400),
    ("prompt + max_tokens over the context", _chat_body(max_tokens=1000), 400),
    ("tools", _chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    (
        "response_format without its schema",
        _chat_body(response_format={"type": "json_schema"}),
        400,
    ),
    ("response_format's schema invalid", _chat_body(response_format=_schema({"type": 3})), 400),
    ("regex that does not parse", _chat_body(structured_outputs={"regex": "([a-z"}), 400),
    ("10,000 stop strings", _chat_body(stop=[f"s{i}" for i in range(10_000)]), 400),
    ("no messages", {"model": "demo", "messages": []}, 400),
    ("unknown model", _chat_body(model="gpt-17"), 404),
]


@pytest.mark.parametrize("body,status", [(b, s) for _, b, s in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status):
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    assert chat(client, "still there?", max_tokens=2).choices[0].message.content


STRICT = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}


async def test_structured_outputs_through_the_fleet(client, aclient):
    """Prefill draws token 1 and decode the rest under the same constraint (the bus
    carries it); streamed, the deltas join to a valid document."""
    out = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=40,
        temperature=0,
        response_format=_schema(STRICT),
    )
    doc = json.loads(out.choices[0].message.content)
    assert set(doc) == {"n", "ok"} and doc["n"] in range(100) and type(doc["ok"]) is bool
    stream = await aclient.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=40,
        temperature=0.9,
        seed=5,
        n=2,
        stream=True,
        response_format=_schema(STRICT),
    )
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(set(json.loads(t)) == {"n", "ok"} for t in texts), texts
    comp = client.completions.create(
        model="demo",
        prompt="pick:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert comp.choices[0].text.strip() in ("left", "right")


def test_transport_level_errors(server, client):
    cases = [
        (
            post(
                server,
                "/v1/chat/completions",
                "{not json",
                headers={"Content-Type": "application/json"},
            ),
            400,
        ),
        (
            post(
                server,
                "/v1/chat/completions",
                json.dumps(_chat_body()),
                headers={"Content-Type": "text/plain"},
            ),
            400,
        ),
        (post(server, "/v1/chat/completions", _chat_body(), key=None), 401),
        (post(server, "/v1/chat/completions", _chat_body(), key="wrong"), 401),
        (
            post(
                server,
                "/v1/chat/completions",
                b"x" * (41 << 20),
                headers={"Content-Type": "application/json"},
            ),
            413,
        ),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["message"]
        assert chat(client, "still there?", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open without a key


def test_the_response_cache_serves_repeats_and_paraphrases(server):
    """The fleet's cache service: a repeated question, then a paraphrase, come from it."""
    plain = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)

    def ask(text: str):
        raw = plain.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=8
        )
        return raw.headers["x-epd-cache"], raw.parse().choices[0].message.content

    status, first = ask("How do I boil an egg so the yolk stays soft?")
    assert status == "miss"
    deadline = time.monotonic() + 10
    while (hit := ask("How do I boil an egg so the yolk stays soft?"))[0] == "miss":
        assert time.monotonic() < deadline  # the store runs after the answer
        time.sleep(0.1)
    # A lookup that overtakes the store's write finds it by meaning: either tier is right.
    assert hit[0] in ("hit-exact", "hit-semantic") and hit[1] == first
    assert ask("How do I boil an egg so the yolk stays soft?") == ("hit-exact", first)
    assert ask("How can I boil an egg so that the yolk stays soft?") == ("hit-semantic", first)
    assert ask("How do I boil an egg so the yolk does not stay soft?")[0] == "miss"


def test_models_health_version_and_docs(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    assert (
        "/v1/chat/completions" in spec["paths"]
        and "ChatCompletionRequest" in spec["components"]["schemas"]
    )
    assert httpx.get(f"{server.base_url}/docs").status_code == 200


async def test_request_ids_are_echoed_and_never_cross(server, client):
    prompts = [f"question number {i}" for i in range(4)]
    solo = [chat(client, p).choices[0].message.content for p in prompts]

    async def ask(http: httpx.AsyncClient, prompt: str, rid: str):
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12,
            "temperature": 0,
        }
        resp = await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
        return resp.headers["x-request-id"], resp.json()["choices"][0]["message"]["content"]

    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60) as http:
        same = await asyncio.gather(*(ask(http, p, "same-id") for p in prompts))
        huge = "r" * 10_000
        echoed, text = await ask(http, prompts[0], huge)
    assert [t for _, t in same] == solo and {r for r, _ in same} == {"same-id"}
    assert echoed == huge and text == solo[0]
    generated = post(server, "/v1/chat/completions", _chat_body())
    assert generated.headers["x-request-id"].startswith("req-")


async def test_a_client_that_disconnects_frees_every_block(server):
    import nats

    from protos.epd_pb import bus_pb2

    beats: dict[str, bus_pb2.Heartbeat] = {}
    nc = await nats.connect(server.nats_url)

    async def on_beat(msg):
        hb = bus_pb2.Heartbeat.FromString(msg.data)
        beats[hb.instance_id] = hb

    await nc.subscribe("epd.hb.*.*", cb=on_beat)
    try:
        await _until(lambda: {"prefill-0", "decode-0"} <= beats.keys())
        free0 = {k: beats[k].free_kv_blocks for k in ("prefill-0", "decode-0")}
        body = _chat_body(max_tokens=200, ignore_eos=True, stream=True)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with (
            httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            lines = 0
            async for line in resp.aiter_lines():
                lines += line.startswith("data:")
                if lines >= 3:
                    break
        await _until(lambda: beats["decode-0"].running == 1, timeout_s=5, must=False)
        await _until(
            lambda: all(
                beats[k].free_kv_blocks == free0[k] and beats[k].running == 0 for k in free0
            )
        )
    finally:
        await nc.close()


async def _until(pred, timeout_s: float = 20, must: bool = True) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        if loop.time() > end:
            assert not must, "condition not reached"
            return
        await asyncio.sleep(0.1)


async def test_fifty_concurrent_streams_all_end_with_done(server):
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http: httpx.AsyncClient, i: int) -> list[str]:
        body = _chat_body(
            messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=16, stream=True
        )
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return [line async for line in resp.aiter_lines() if line.startswith("data:")]

    limits = httpx.Limits(max_connections=60)
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=headers, timeout=120, limits=limits
    ) as http:
        results = await asyncio.gather(*(one(http, i) for i in range(50)))
    assert all(r[-1] == "data: [DONE]" and len(r) >= 3 for r in results)


def test_no_generated_request_gets_a_server_error(server):
    """schemathesis against /openapi.json: whatever the schema admits (25 examples an
    operation, derandomized), no answer is a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    spec = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    checked = []
    for result in spec.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=25,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            assert response.status_code < 500, (case.body, response.text[:500])

        check()
        checked.append(operation.label)
    assert "POST /v1/chat/completions" in checked and len(checked) >= 8
