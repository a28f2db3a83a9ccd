"""GET /dashboard on a live fleet (encoder, prefill, two decodes, a cache service and a
gateway over private NATS and Redis): the state API lists every instance by role with
its load and KV blocks, its rolling stats follow real requests (TTFT, TPOT, cache hits),
a stopped decode stays visible as "gone" and is forgotten later, the page needs no API
key, and headless Chromium renders the live page (instance ids and request counts in
the DOM, chart colours in the screenshot) while requests run."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from cache_svc.config import SemanticCacheConfig
from cache_svc.service import CacheService
from gateway.dashboard.fleet import FleetView
from gateway.rest.app import build_app
from launch.localstack import start_nats, start_redis
from services.config import EngineConfig
from tests.integration.stack import service_config, start_aggregated, start_disaggregated

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CACHE = SemanticCacheConfig(cache_lookup_timeout_ms=2000)
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def servers():
    with start_nats() as nats, start_redis() as redis:
        yield nats.url, redis.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(demo_dir, servers):
    nats, redis = servers
    engine = EngineConfig(model="demo", demo_dir=str(demo_dir), num_kv_blocks=256)
    cache = CacheService(service_config(nats, redis, "cache-dash"), CACHE)
    await cache.start()
    stack = await start_disaggregated(engine, nats, redis, "dash", num_decode=2, cache=CACHE)
    base = f"http://127.0.0.1:{stack.gateway.http_port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            yield stack, client
    finally:
        await stack.stop()
        await cache.stop()


async def state(client: httpx.AsyncClient) -> dict:
    response = await client.get("/dashboard/api/state")
    assert response.status_code == 200, response.text
    return response.json()


async def state_until(client: httpx.AsyncClient, holds, timeout_s: float = 10.0) -> dict:
    """The state once ``holds(state)``: heartbeats arrive every 0.2 s, so poll (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = await state(client)
        if holds(doc) or time.monotonic() > deadline:
            return doc
        await asyncio.sleep(0.05)


def by_id(doc: dict) -> dict[str, dict]:
    return {row["id"]: row for row in doc["instances"]}


async def ask(client: httpx.AsyncClient, text: str, max_tokens: int = 8) -> str:
    """One chat completion; its x-epd-cache outcome."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-epd-cache"]


async def test_state_lists_every_instance_by_role(fleet):
    stack, client = fleet
    doc = await state_until(client, lambda d: "cache-dash" in by_id(d))
    rows = by_id(doc)
    assert doc["mode"] == "disaggregated" and doc["model"] == "demo"
    expected = {
        "gateway-dash": "gateway",
        "encoder-dash": "encode",
        "prefill-dash": "prefill",
        "decode0-dash": "decode",
        "decode1-dash": "decode",
        "cache-dash": "cache",
    }
    assert {iid: rows[iid]["role"] for iid in expected} == expected
    assert all(rows[iid]["state"] == "serving" for iid in expected)
    for iid in ("encoder-dash", "prefill-dash", "decode0-dash"):
        assert rows[iid]["model"] == "demo"  # the fingerprint, named
        assert 0 <= rows[iid]["heartbeat_age_s"] < 1.0  # TTL 1 s: heard within it
        assert rows[iid]["inflight"] == 0
    assert rows["decode0-dash"]["total_kv_blocks"] == 256
    assert 0 < rows["decode0-dash"]["free_kv_blocks"] <= 256
    assert rows["cache-dash"]["inflight"] is None  # not routed by this gateway


async def test_rolling_stats_follow_requests(fleet):
    _, client = fleet
    before = (await state(client))["stats"]["totals"]
    questions = [f"Tell me about the number {i}." for i in range(6)]
    outcomes = await asyncio.gather(*(ask(client, q) for q in questions))
    assert outcomes == ["miss"] * 6
    # The store runs after the answer is sent: ask again until it is there (bounded).
    deadline, hit = time.monotonic() + 10, "miss"
    while hit != "hit-exact" and time.monotonic() < deadline:
        hit = await ask(client, questions[0])
    assert hit == "hit-exact"
    totals = (await state(client))["stats"]["totals"]
    asked = totals["requests"] - before["requests"]
    assert asked >= 7
    assert totals["errors"] == before["errors"]
    assert totals["cache"]["hit-exact"] >= before["cache"]["hit-exact"] + 1
    assert totals["cache"]["miss"] >= before["cache"]["miss"] + 6
    assert 0 < totals["hit_rate"] < 1
    assert 0 < totals["ttft"]["p50"] <= totals["ttft"]["p90"] <= totals["ttft"]["p99"] < 30
    assert 0 < totals["tpot"]["p50"] <= totals["tpot"]["p99"] < 30
    assert totals["tokens"] - before["tokens"] >= asked  # every request streamed tokens
    buckets = (await state(client))["stats"]["buckets"]
    assert len(buckets) == 60 and sum(b["requests"] for b in buckets) == totals["requests"]


async def test_the_dashboard_needs_no_api_key(fleet):
    stack, _ = fleet
    core = copy.copy(stack.gateway.core)  # the same fleet, behind an API key
    core.config = dataclasses.replace(core.config, api_key=("secret",))
    transport = httpx.ASGITransport(app=build_app(core))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get("/v1/models")).status_code == 401  # the key is enforced
        for path in (
            "/dashboard",
            "/dashboard/app.js",
            "/dashboard/style.css",
            "/dashboard/api/state",
        ):
            assert (await client.get(path)).status_code == 200, path
        page = await client.get("/dashboard")
        assert page.headers["content-type"].startswith("text/html")
        assert "/dashboard/app.js" in page.text
        assets = [
            (await client.get(p)).text
            for p in ("/dashboard", "/dashboard/app.js", "/dashboard/style.css")
        ]
        assert sum(len(a.encode()) for a in assets) < 50_000
        for text in assets:  # nothing from elsewhere (users run offline): no CDN, no fonts
            assert not re.search(r"https?:|(src|href)=\"//|@import|url\(", text)


async def test_a_stopped_decode_shows_as_gone_then_is_forgotten(fleet):
    stack, client = fleet
    backend = stack.gateway.core.backend
    shift = [0.0]
    view = FleetView(backend, gone_s=60.0, clock=lambda: time.monotonic() + shift[0])
    assert {r["id"]: r["state"] for r in await view.rows()}["decode1-dash"] == "serving"
    await stack.decodes[1].stop()

    def decode1_expired() -> bool:
        live = backend.registry.live("decode", include_draining=True)
        return all(i.instance_id != "decode1-dash" for i in live)

    await backend.registry.wait_for(decode1_expired, timeout_s=10)
    rows = by_id(await state(client))
    assert rows["decode1-dash"]["state"] == "gone"
    assert rows["decode1-dash"]["heartbeat_age_s"] >= 1.0  # silent past the TTL
    assert rows["decode0-dash"]["state"] == "serving"
    assert {r["id"]: r["state"] for r in await view.rows()}["decode1-dash"] == "gone"
    shift[0] = 62.0  # a minute later: forgotten; the live ones stay
    ids = {r["id"] for r in await view.rows()}
    assert "decode1-dash" not in ids and "decode0-dash" in ids
    assert await ask(client, "Still serving with one decode?", 4) == "miss"


async def test_serve_all_shows_its_one_engine(demo_dir, servers):
    engine = EngineConfig(model="demo", demo_dir=str(demo_dir), num_kv_blocks=128)
    stack = await start_aggregated(engine, *servers, "dash-all")
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{stack.gateway.http_port}", timeout=60
        ) as client:
            await ask(client, "One engine?", 4)
            doc = await state(client)
    finally:
        await stack.stop()
    assert doc["mode"] == "aggregated"
    assert [r["role"] for r in doc["instances"]] == ["gateway", "engine"]
    engine_row = doc["instances"][1]
    assert engine_row["state"] == "serving" and engine_row["total_kv_blocks"] == 128
    assert engine_row["free_kv_blocks"] == 128  # the request finished: its blocks are back
    totals = doc["stats"]["totals"]
    assert totals["requests"] == 1 and totals["cache"]["off"] == 1 and totals["ttft"]


async def chromium(*args: str, timeout_s: float = 120) -> bytes:
    argv = [
        shutil.which("chromium") or "chromium",
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        "--window-size=1400,700",
        "--virtual-time-budget=6000",
        *args,
    ]
    # Not subprocess.run: the fleet runs on this event loop and must keep serving the page.
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


def has_colour(image: Image.Image, rgb: tuple[int, int, int], at_least: int = 20) -> bool:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    near = (np.abs(pixels - np.array(rgb, dtype=np.int16)) <= 6).all(axis=-1)
    return int(near.sum()) >= at_least


async def test_the_page_renders_live_in_chromium(fleet, tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    stack, client = fleet
    url = f"http://127.0.0.1:{stack.gateway.http_port}/dashboard"
    stop = asyncio.Event()

    async def load() -> int:  # requests while the browser watches
        n = 0
        while not stop.is_set():
            await asyncio.gather(*(ask(client, f"Load {n} {k}?", 6) for k in range(3)))
            n += 3
        return n

    loader = asyncio.create_task(load())
    try:
        dom = (await chromium(f"--user-data-dir={tmp_path / 'p1'}", "--dump-dom", url)).decode()
        shot = tmp_path / "dashboard.png"
        await chromium(f"--user-data-dir={tmp_path / 'p2'}", f"--screenshot={shot}", url)
    finally:
        stop.set()
        assert await loader > 0
    for iid in ("decode0-dash", "decode1-dash", "prefill-dash", "encoder-dash", "cache-dash"):
        assert f">{iid}<" in dom, iid
    assert re.search(r'class="gone" data-instance="decode1-dash"', dom)
    requests = int(re.search(r'id="total-requests">(\d+)<', dom).group(1))
    assert requests > 0
    assert "gateway unreachable" not in dom
    image = Image.open(io.BytesIO(shot.read_bytes()))
    assert image.size == (1400, 700)
    assert has_colour(image, (0x3B, 0x6F, 0xD8))  # request-rate bars
    assert has_colour(image, (0x2E, 0x9E, 0x6A))  # p50 lines / exact hits
    if os.environ.get("EPD_UPDATE_DOCS") == "1":  # refresh the README's screenshot
        shutil.copyfile(shot, DOCS_SCREENSHOT)
