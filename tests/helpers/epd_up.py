"""``epd up`` as a user runs it: a subprocess with its own NATS, Redis and services."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from launch.localstack import free_port
from launch.stack import wait_for_grpc

READY_LINE = "epd-serve is up"  # the first line of the block `epd up` prints when healthy


@dataclass
class Running:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    nats_url: str  # without credentials
    demo_dir: Path
    redis_url: str = ""  # without credentials
    lines: list[str] = field(default_factory=list)  # the output so far, read by a thread
    _reader: threading.Thread | None = None
    _more: threading.Condition = field(default_factory=threading.Condition)  # a line came
    _ended: bool = False  # the output closed (the process is gone)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start_reading(self) -> None:
        """Collect the output as it comes, so a test can wait for a line while the
        process runs (a pipe nobody reads would also block it once full)."""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._more:
                self.lines.append(line)
                self._more.notify_all()
        with self._more:
            self._ended = True
            self._more.notify_all()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        """Until a line containing ``text`` was printed; the process exiting or the
        time running out first is an error."""
        deadline = time.monotonic() + timeout_s
        with self._more:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    raise TimeoutError(f"`epd up` never printed {text!r}")
                self._more.wait(timeout=left)

    def stop(self, timeout_s: float = 60) -> str:
        """SIGTERM, wait; the whole output (the test checks the exit code)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
        return self.output()


def epd_up(
    demo_dir: Path,
    *args: str,
    env: dict | None = None,
    ready_s: float = 240,
    nats_userinfo: str = "",
    redis_password: str = "",
) -> Running:
    """Start ``epd up`` on free ports and wait until it says it is up (its own health
    check passed) and REST and gRPC both serve. ``nats_userinfo`` ("user:password" or a
    token) and ``redis_password``: the local servers require them, and every service
    authenticates."""
    http_port, grpc_port, nats_port, redis_port = (free_port() for _ in range(4))
    nats_url = f"nats://127.0.0.1:{nats_port}"
    nats_auth = f"{nats_userinfo}@" if nats_userinfo else ""
    redis_auth = f":{redis_password}@" if redis_password else ""
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "up",
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--nats-url",
        f"nats://{nats_auth}127.0.0.1:{nats_port}",
        "--redis-url",
        f"redis://{redis_auth}127.0.0.1:{redis_port}/0",
        *args,
    ]
    full_env = dict(os.environ, EPD_DEMO_DIR=str(demo_dir), **(env or {}))
    proc = subprocess.Popen(
        argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    running = Running(
        proc, http_port, grpc_port, nats_url, demo_dir, f"redis://127.0.0.1:{redis_port}/0"
    )
    running.start_reading()
    try:
        # `epd up` prints its block only after its own check (gRPC lists every model);
        # a signal sent before that would interrupt the check, and the block is what a
        # user waits for.
        running.wait_for_line(READY_LINE, timeout_s=ready_s)
        wait_for_grpc(grpc_port, timeout_s=30)
        deadline = time.monotonic() + 30
        while httpx.get(f"{running.base_url}/health", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("REST /health never turned 200")
            time.sleep(0.2)
    except BaseException:
        print(running.stop()[-5000:])
        raise
    return running
