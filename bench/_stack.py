"""Benchmark helper: service processes (``epd serve <role>``) on 127.0.0.1 with logs.

``Fleet`` owns every child it spawns and the private NATS / Redis servers; ``close()``
stops them all (gateways first, then workers, then the servers) and is safe to call
twice, so a benchmark can call it from ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.localstack import ServerProcess, free_port, start_nats, start_redis

HOST = "127.0.0.1"


@dataclass
class Child:
    """One service process and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, max_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-max_chars:]
        return ""


@dataclass
class Fleet:
    """Private NATS + Redis and the service processes started against them."""

    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="epd-bench-")))
    model: str = "demo"  # every service's --model
    nats: ServerProcess | None = None
    redis: ServerProcess | None = None
    children: list[Child] = field(default_factory=list)
    # instance -> its REST port (gateways)
    http_ports: dict[str, int] = field(default_factory=dict)

    def start_servers(self) -> None:
        self.nats = start_nats(host=HOST)
        self.redis = start_redis(host=HOST, maxmemory="512mb")

    def spawn(
        self,
        role: str,
        instance: str,
        log_level: str = "INFO",
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> int:
        """Start ``epd serve <role>`` (on ``cpus`` only, if given; ``env``: extra EPD_*
        settings); returns its gRPC port (meaningful for gateways; the REST port is
        ``http_ports[instance]``)."""
        assert self.nats is not None and self.redis is not None, "start_servers() first"
        grpc_port = free_port(HOST)
        self.http_ports[instance] = free_port(HOST)
        argv = [
            sys.executable,
            "-m",
            "launch.cli",
            "--log-level",
            log_level,
            "serve",
            role,
            "--model",
            self.model,
            "--nats-url",
            self.nats.url,
            "--redis-url",
            self.redis.url,
            "--instance-id",
            instance,
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(self.http_ports[instance]),
        ]
        # EPD_HOST: the gateway listens on the loopback interface only.
        env = dict(os.environ, EPD_HOST=HOST, PYTHONUNBUFFERED="1", **(env or {}))
        log = self.logdir / f"{instance}.log"
        with open(log, "wb") as out:
            pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
            proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin
            )
        self.children.append(Child(instance, proc, log))
        return grpc_port

    def check_alive(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")

    def wait_healthy(self, port: int, timeout_s: float) -> None:
        """Until the gateway on ``port`` reports SERVING; fails fast if a child died."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"{HOST}:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                self.check_alive()
                with contextlib.suppress(grpc.RpcError):
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.2)
        raise TimeoutError(f"gateway on port {port} not SERVING within {timeout_s:.0f}s")

    def close(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child (last started first), kill stragglers, stop the servers."""
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children.clear()
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()
        self.redis = self.nats = None
