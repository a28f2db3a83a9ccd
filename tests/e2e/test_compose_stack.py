"""A running `docker compose` stack serves REST and shares its semantic cache.

Runs only against a stack that is already up (Docker is not part of the test run):

    docker compose up --build --wait
    EPD_COMPOSE_URL=http://127.0.0.1:8000 pytest tests/e2e/test_compose_stack.py

It proves what compose_check.sh (gRPC health + GenerateOnce) does not: the gateway's REST
port, /metrics and /dashboard are published; a chat completion goes E -> P -> D; a
second identical request is answered by the cache service from the password-protected
Redis (``x-epd-cache: hit-exact``); every worker role has a serving instance."""

from __future__ import annotations

import os
import time

import httpx
import pytest

URL = os.environ.get("EPD_COMPOSE_URL", "")
pytestmark = pytest.mark.skipif(not URL, reason="EPD_COMPOSE_URL not set (no compose stack)")


def _chat(client: httpx.Client, messages: list[dict], **params) -> httpx.Response:
    body = {"model": "demo", "messages": messages, "max_tokens": 8, "temperature": 0, **params}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_rest_health_metrics_dashboard():
    with httpx.Client(base_url=URL, timeout=30) as client:
        assert client.get("/health").status_code == 200
        assert "epd_gateway_requests_in_progress" in client.get("/metrics").text
        assert client.get("/dashboard").status_code == 200
        state = client.get("/dashboard/api/state").json()
    roles = {i["role"] for i in state["instances"] if i["state"] == "serving"}
    assert {"encode", "prefill", "decode", "cache"} <= roles


def test_second_identical_request_hits_the_cache():
    # A system prompt of its own (part of the cache fingerprint): a rerun starts with a
    # miss. The answer, cut at its second word by a stop string, finishes with "stop":
    # only complete answers are stored.
    messages = [
        {"role": "system", "content": f"compose test {time.time_ns()}"},
        {"role": "user", "content": "Say hello to the compose stack."},
    ]
    with httpx.Client(base_url=URL, timeout=180) as client:
        words = _chat(client, messages).json()["choices"][0]["message"]["content"].split()
        assert len(words) >= 2, words
        miss = _chat(client, messages, stop=[words[1]])
        assert miss.headers["x-epd-cache"] == "miss"
        assert miss.json()["choices"][0]["finish_reason"] == "stop"
        deadline = time.monotonic() + 10  # the store is written after the answer
        while True:
            hit = _chat(client, messages, stop=[words[1]])
            if hit.headers["x-epd-cache"] == "hit-exact" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert hit.headers["x-epd-cache"] == "hit-exact"
    assert hit.json()["choices"][0]["message"] == miss.json()["choices"][0]["message"]
