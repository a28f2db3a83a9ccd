"""The gateway is a thin front (DESIGN.md): a fleet gateway process that starts and
answers health checks never imports torch or the model classes."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, json, resource, sys, time
t0 = time.perf_counter()
from gateway.app import Gateway
from gateway.config import GatewayConfig
from services.config import EngineConfig, ServiceConfig

async def main():
    cfg = ServiceConfig(nats_url=sys.argv[1], grpc_port=0, instance_id="gw-torch-free")
    gw = Gateway(EngineConfig(model="demo", demo_dir=sys.argv[2]), cfg, aggregated=False,
                 api=GatewayConfig(http_port=0))
    await gw.start()
    started = time.perf_counter() - t0
    import httpx
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"http://127.0.0.1:{gw.http_port}/health")).status_code
        tok = await http.post(f"http://127.0.0.1:{gw.http_port}/tokenize",
                              json={"model": "demo", "prompt": "hello world"})
    await gw.stop()
    heavy = [m for m in ("torch", "transformers.models.llama", "services.models.llama",
                         "services.engine.llm_engine") if m in sys.modules]
    print(json.dumps({"heavy": heavy, "started_s": started, "health": health,
                      "tokens": tok.json()["tokens"],
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))

asyncio.run(main())
"""


def test_a_fleet_gateway_imports_no_torch(nats_server, tmp_path_factory):
    from services.models.demo import ensure_demo_model
    from services.tokenization import load_tokenizer

    demo_root = tmp_path_factory.mktemp("demo")
    demo = ensure_demo_model(demo_root)  # generating it needs torch: not in the gateway
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, nats_server.url, str(demo_root)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=".",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["health"] == 503  # no workers: up, but not ready
    assert result["tokens"] == load_tokenizer(demo).encode("hello world")
