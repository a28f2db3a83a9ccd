"""Structured outputs over the OpenAI API, as users send them with the official client,
against `epd serve all` (`epd up --aggregated`) on the random-weight demo model: every
valid output is the grammar's doing. The fleet refuses them with a 400 (test_rest_api)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow
BYPASS = {"x-epd-cache": "bypass"}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rank", "open"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    doc = json.loads(text)
    return (
        set(doc) == {"city", "rank", "open"}
        and len(doc["city"]) <= 10
        and doc["rank"] in range(1, 10)
        and type(doc["open"]) is bool
    )


@pytest.fixture(scope="module")
def server(demo_dir):
    running = epd_up(demo_dir, "--aggregated", "--max-model-len", "256")
    yield running
    output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, default_headers=BYPASS
    )


def _chat(client, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "a city?"}], **kw
    )


def test_json_schema_json_object_and_text(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    out = _chat(client, response_format=fmt, temperature=0)
    assert out.choices[0].finish_reason == "stop" and valid(out.choices[0].message.content)
    sampled = _chat(client, response_format=fmt, temperature=1.0, seed=4, n=2)
    assert len(sampled.choices) == 2 and all(valid(c.message.content) for c in sampled.choices)
    obj = _chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=8)
    text = obj.choices[0].message.content
    assert text.startswith("{") or obj.choices[0].finish_reason == "length"
    assert _chat(client, response_format={"type": "text"}, max_tokens=4).choices[0].message


def test_models_say_what_is_supported(client):
    (card,) = client.models.list().data
    assert card.structured_outputs == [
        "json",
        "json_object",
        "regex",
        "choice",
        "grammar",
        "structural_tag",
    ]
    assert card.tool_calling is False and card.reasoning is False


def test_streamed_json_joins_to_a_valid_document(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    stream = _chat(client, response_format=fmt, temperature=0.7, seed=2, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert valid(text), text


def test_vllm_structured_outputs_on_chat_and_completions(client):
    out = _chat(client, extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}})
    assert re.fullmatch(r"[0-9]{2}-[a-c]{3}", out.choices[0].message.content.strip())
    for seed in range(3):
        comp = client.completions.create(
            model="demo",
            prompt="pick one:",
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
        )
        assert comp.choices[0].text.strip() in ("alpha", "beta")
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    assert _chat(client, response_format=tag, max_tokens=8).choices[0].finish_reason
    guided = _chat(client, extra_body={"guided_choice": ["up", "down"]})
    assert guided.choices[0].message.content.strip() in ("up", "down")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": {"structures": []}}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": 5}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            None,
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, client, extra, param):
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**body, **extra}, headers=BYPASS
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert _chat(client, max_tokens=2).choices[0].message.content is not None
