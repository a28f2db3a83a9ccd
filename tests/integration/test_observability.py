"""Metrics and logs of a real fleet (encoder, prefill, decode, gateway in this process,
real NATS and Redis): one request moves the gateway's and the engine's metrics, served
both on the gateway's REST port and on a worker's own metrics port; JSON log lines of
the gateway and of the workers about that request carry the same internal request id
(never the client's); secrets in the NATS and Redis URLs never reach a log line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from decode_svc.service import DecodeService
from encoder_svc.service import EncoderService
from gateway.app import Gateway
from launch.localstack import ServerProcess, start_nats, start_redis
from prefill_svc.service import PrefillService
from services.config import EngineConfig
from services.observability import ObservabilityConfig, make_handler
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CLIENT_ID = "client-chosen-id-42"
NATS_PASSWORD = "nats-Pw-71c2e"
REDIS_PASSWORD = "redis-Pw-90ab3"


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    return EngineConfig(
        model="demo", demo_dir=str(tmp_path_factory.mktemp("demo")), num_kv_blocks=128
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(engine_config, nats_server, redis_server) -> AsyncIterator[dict]:
    """The fleet, each worker with a metrics server on a free port."""

    def cfg(name: str):
        return service_config(nats_server.url, redis_server.url, f"{name}-obs")

    workers = [
        EncoderService(engine_config, cfg("encoder")),
        PrefillService(engine_config, cfg("prefill")),
        DecodeService(engine_config, cfg("decode")),
    ]
    for w in workers:
        w.observability = ObservabilityConfig(metrics_port=0)
    gw: Gateway | None = None
    try:
        await asyncio.gather(*(w.start() for w in workers))
        gw = await start_gateway(engine_config, cfg("gateway"), aggregated=False)
        registry, fp = gw.core.backend.registry, gw.core.info.fingerprint
        await registry.wait_for(
            lambda: all(
                any(i.model == fp for i in registry.live(role))
                for role in ("encode", "prefill", "decode")
            ),
            timeout_s=10.0,
        )
        yield {"gateway": gw, "encoder": workers[0], "prefill": workers[1], "decode": workers[2]}
    finally:
        if gw is not None:
            await gw.stop()
        for w in workers:
            await w.stop()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from a Prometheus text page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(page: dict, name: str, **labels) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(url: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(url)
    assert resp.status_code == 200
    return samples(resp.text)


async def chat(gw: Gateway, text: str, max_tokens: int = 6) -> dict:
    body = {
        "model": "demo",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=60) as http:
        resp = await http.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": CLIENT_ID}
        )
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_one_request_moves_the_metrics_on_both_ports(fleet):
    gw, decode = fleet["gateway"], fleet["decode"]
    gw_url = f"http://127.0.0.1:{gw.http_port}/metrics"
    worker_url = f"http://127.0.0.1:{decode.metrics_port}/metrics"
    assert decode.metrics_port > 0
    before_gw, before_worker = await scrape(gw_url), await scrape(worker_url)
    out = await chat(gw, "count the ducks in the pond")
    after_gw, after_worker = await scrape(gw_url), await scrape(worker_url)

    def delta(before: dict, after: dict, name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(before_gw, after_gw, "epd_gateway_requests_total", outcome="ok") == 1
    assert delta(before_gw, after_gw, "epd_gateway_ttft_seconds_count") == 1
    assert delta(before_gw, after_gw, "epd_gateway_e2e_seconds_count") == 1
    tokens = out["usage"]["completion_tokens"]
    assert delta(before_gw, after_gw, "epd_gateway_generated_tokens_total") == tokens
    assert delta(before_gw, after_gw, "epd_gateway_tpot_seconds_count") == (tokens > 1)
    # The worker's page: prefill ran once (on the prefill instance), decode sampled.
    assert delta(before_worker, after_worker, "epd_engine_prefill_seconds_count") == 1
    assert delta(before_worker, after_worker, "epd_engine_queue_seconds_count") >= 1
    assert delta(before_worker, after_worker, "epd_engine_generated_tokens_total") >= tokens
    assert (
        delta(before_worker, after_worker, "epd_bus_request_seconds_count", subject="epd.prefill")
        == 1
    )
    ids = {"role": "decode", "instance": decode.instance_id}
    assert value(after_worker, "epd_instance_kv_blocks_free", **ids) > 0
    assert (
        value(after_worker, "epd_instance_kv_blocks_free", **ids)
        + value(after_worker, "epd_instance_kv_blocks_used", **ids)
    ) == 128
    assert ("epd_instance_running", tuple(sorted(ids.items()))) in after_worker


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Every log line of this process, as the JSON format writes it, at DEBUG."""
    buf = io.StringIO()
    handler = make_handler(ObservabilityConfig(log_format="json"), stream=buf)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_gateway_and_worker_lines_carry_the_same_internal_request_id(fleet, json_lines):
    await chat(fleet["gateway"], "what colour is the sky")
    lines = [json.loads(line) for line in json_lines.getvalue().splitlines()]
    assert all(
        set(line) >= {"time", "level", "service", "instance", "request_id", "logger", "message"}
        for line in lines
    )
    done = [
        ln for ln in lines if ln["service"] == "gateway" and ln["message"].startswith("request ok")
    ]
    assert len(done) == 1
    rid = done[0]["request_id"]
    assert rid and rid != CLIENT_ID
    about = [ln for ln in lines if ln["request_id"] == rid]
    assert {"prefill", "decode"} <= {ln["service"] for ln in about}
    assert {ln["instance"] for ln in about if ln["service"] == "prefill"} == {"prefill-obs"}
    assert not any(ln["request_id"] == CLIENT_ID for ln in lines)


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    auth = f'authorization {{ users = [ {{user: alice, password: "{NATS_PASSWORD}"}} ] }}'
    with start_nats(extra_config=auth) as nats, start_redis(password=REDIS_PASSWORD) as redis:
        yield nats, redis


async def test_passwords_in_urls_never_reach_the_logs(engine_config, secured, json_lines):
    nats, redis = secured
    nats_url = f"nats://alice:{NATS_PASSWORD}@127.0.0.1:{nats.port}"
    redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/0"
    text = io.StringIO()
    text_handler = make_handler(ObservabilityConfig(), stream=text)
    logging.getLogger().addHandler(text_handler)
    try:
        cfg = service_config(nats_url, redis_url, "encoder-secret")
        encoder = EncoderService(engine_config, cfg)
        encoder.observability = ObservabilityConfig(metrics_port=0)
        logging.getLogger("test").info("starting with %s and %r", nats_url, cfg)
        await encoder.start()
        assert await encoder.store.get(encoder.fingerprint, "0" * 64) is None  # Redis answers
        await encoder.stop()
    finally:
        logging.getLogger().removeHandler(text_handler)
    for output in (json_lines.getvalue(), text.getvalue()):
        assert "encoder-secret ready" in output  # the start was captured
        assert NATS_PASSWORD not in output and REDIS_PASSWORD not in output
        assert "alice:***@" in output


async def test_serve_all_reports_its_engine_load_on_metrics(
    engine_config, nats_server, redis_server
):
    """`epd serve all` sends no heartbeat: its engine's gauges are read at scrape time."""
    cfg = service_config(nats_server.url, redis_server.url, "all-gauges")
    gw = await start_gateway(engine_config, cfg, aggregated=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
            text = (await http.get("/metrics")).text
        samples = {
            (s.name, s.labels.get("instance")): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        free = samples[("epd_instance_kv_blocks_free", "all-gauges")]
        used = samples[("epd_instance_kv_blocks_used", "all-gauges")]
        assert free > 0 and used == 0 and samples[("epd_instance_running", "all-gauges")] == 0
    finally:
        await gw.stop()
