"""The bus against nats-servers that demand credentials or TLS: user/password and token
in the URL, TLS with a private CA (server-only and mutual), the way every service
connects (``connect_bus`` from a ``ServiceConfig``); a wrong password or an untrusted
certificate fails at once with a clear error, and no secret reaches a log line.

Not covered here: nkey seed and .creds files. nats-py signs with the ``nkeys`` package,
which is not installed; the unit tests check what reaches nats-py and the clear error
without it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.localstack import ServerProcess, start_nats
from protos.epd_pb import bus_pb2
from services.bus.auth import NatsAuth
from services.bus.connection import Bus, BusConfig, Incoming
from services.bus.errors import BusUnavailable
from services.config import ServiceConfig
from services.runtime import connect_bus
from tests.integration.secure_servers import Pki, make_pki

PASSWORD = "s3cr%t@pw"  # needs percent-encoding in a URL: "%" -> %25, "@" -> %40
URL_PASSWORD = "s3cr%25t%40pw"
TOKEN = "tok-9f8e7d"


@pytest.fixture(scope="module")
def nats_users() -> Iterator[ServerProcess]:
    config = f'authorization {{ users = [ {{user: alice, password: "{PASSWORD}"}} ] }}'
    with start_nats(extra_config=config) as server:
        yield server


@pytest.fixture(scope="module")
def nats_token() -> Iterator[ServerProcess]:
    with start_nats(extra_config=f'authorization {{ token: "{TOKEN}" }}') as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_block(pki: Pki, verify: bool) -> str:
    return (
        f'tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", '
        f'ca_file: "{pki.ca}", verify: {str(verify).lower()}, timeout: 2 }}'
    )


@pytest.fixture(scope="module")
def nats_tls(pki: Pki) -> Iterator[ServerProcess]:
    """TLS required; clients are not asked for a certificate; user/password on top."""
    auth = f'authorization {{ users = [ {{user: alice, password: "{PASSWORD}"}} ] }}'
    with start_nats(extra_config=_tls_block(pki, verify=False) + "\n" + auth) as server:
        yield server


@pytest.fixture(scope="module")
def nats_mtls(pki: Pki) -> Iterator[ServerProcess]:
    """TLS required and a client certificate signed by the CA required (mutual TLS)."""
    with start_nats(extra_config=_tls_block(pki, verify=True)) as server:
        yield server


def _url(server: ServerProcess, userinfo: str = "", scheme: str = "nats") -> str:
    return f"{scheme}://{userinfo}{server.host}:{server.port}"


async def _round_trip(bus_a: Bus, bus_b: Bus) -> None:
    """A request on one connection answered on the other."""

    async def echo(msg: Incoming) -> None:
        hb = msg.decode(bus_pb2.Heartbeat)
        await msg.respond(bus_pb2.Heartbeat(instance_id=hb.instance_id, running=hb.running + 1))

    await bus_a.subscribe("t.secure.echo", echo)
    await bus_a.flush()
    reply = await bus_b.request(
        "t.secure.echo", bus_pb2.Heartbeat(instance_id="x", running=1), bus_pb2.Heartbeat, 2.0
    )
    assert (reply.instance_id, reply.running) == ("x", 2)


async def _connect_pair(config: BusConfig) -> tuple[Bus, Bus]:
    return await Bus.connect(config), await Bus.connect(config)


async def _closed(*buses: Bus) -> None:
    for bus in buses:
        await bus.close()


async def test_user_password_in_the_url_connects_and_is_not_logged(
    nats_users: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = BusConfig(servers=(_url(nats_users, f"alice:{URL_PASSWORD}@"),), name="pw")
    assert config.servers == (_url(nats_users),)  # the secret left the URL ...
    assert (config.auth.user, config.auth.password) == ("alice", PASSWORD)  # ... decoded
    assert PASSWORD not in repr(config) and URL_PASSWORD not in repr(config)
    a, b = await _connect_pair(config)
    try:
        await _round_trip(a, b)
    finally:
        await _closed(a, b)
    assert "bus connected" in caplog.text
    assert PASSWORD not in caplog.text and URL_PASSWORD not in caplog.text


async def test_token_in_the_url_connects(nats_token: ServerProcess) -> None:
    config = BusConfig(servers=(_url(nats_token, f"{TOKEN}@"),), name="token")
    assert config.auth.token == TOKEN and TOKEN not in repr(config)
    a, b = await _connect_pair(config)
    try:
        await _round_trip(a, b)
    finally:
        await _closed(a, b)


@pytest.mark.parametrize("userinfo", ["alice:wrong@", "", "mallory:x@"])
async def test_wrong_or_missing_credentials_fail_fast_and_clearly(
    nats_users: ServerProcess, userinfo: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = BusConfig(servers=(_url(nats_users, userinfo),), connect_timeout_s=20.0)
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="(?i)refused.*authorization violation"):
        await Bus.connect(config)
    # Without the fail-fast, nats-py retries until the 20 s connect timeout.
    assert time.monotonic() - started < 5.0
    assert "wrong" not in caplog.text


async def test_wrong_token_fails_fast(nats_token: ServerProcess) -> None:
    with pytest.raises(BusUnavailable, match="(?i)authorization violation"):
        await Bus.connect(BusConfig(servers=(_url(nats_token, "nope@"),), connect_timeout_s=20))


async def test_tls_with_only_a_ca_and_a_password(nats_tls: ServerProcess, pki: Pki) -> None:
    auth = NatsAuth(tls_ca=str(pki.ca))
    for scheme in ("tls", "nats"):  # the CA alone turns TLS on; tls:// says it too
        url = _url(nats_tls, f"alice:{URL_PASSWORD}@", scheme)
        a, b = await _connect_pair(BusConfig(servers=(url,), name="tls", auth=auth))
        try:
            assert a.client.connected_url.scheme == scheme
            await _round_trip(a, b)
        finally:
            await _closed(a, b)


async def test_tls_with_an_untrusted_ca_fails_fast(nats_tls: ServerProcess, pki: Pki) -> None:
    config = BusConfig(
        servers=(_url(nats_tls, f"alice:{URL_PASSWORD}@", "tls"),),
        auth=NatsAuth(tls_ca=str(pki.other_ca)),
        connect_timeout_s=20,
    )
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="(?i)certificate verify failed"):
        await Bus.connect(config)
    assert time.monotonic() - started < 5.0


async def test_credentials_never_cross_a_connection_that_should_be_tls(pki: Pki) -> None:
    """A server (or a man in the middle) that does not ask for TLS gets no password
    from a client configured for TLS: nats-py would upgrade only when asked."""
    received = bytearray()

    async def plaintext_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        writer.write(
            b'INFO {"server_id":"fake","version":"2.10.0","proto":1,'
            b'"max_payload":1048576,"headers":true,"auth_required":true}\r\n'
        )
        await writer.drain()
        received.extend(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(plaintext_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for scheme, auth in (("tls", NatsAuth()), ("nats", NatsAuth(tls_ca=str(pki.ca)))):
            url = f"{scheme}://alice:{URL_PASSWORD}@127.0.0.1:{port}"
            config = BusConfig(servers=(url,), auth=auth, connect_timeout_s=20)
            with pytest.raises(BusUnavailable, match="secure connection not available"):
                await Bus.connect(config)
    finally:
        server.close()
        await server.wait_closed()
    assert b"alice" not in received and PASSWORD.encode() not in received


async def test_mutual_tls_needs_the_client_certificate(nats_mtls: ServerProcess, pki: Pki) -> None:
    url = _url(nats_mtls, scheme="tls")
    full = NatsAuth(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    a, b = await _connect_pair(BusConfig(servers=(url,), name="mtls", auth=full))
    try:
        await _round_trip(a, b)
    finally:
        await _closed(a, b)
    no_cert = BusConfig(servers=(url,), auth=NatsAuth(tls_ca=str(pki.ca)), connect_timeout_s=3)
    with pytest.raises(BusUnavailable):  # the server drops the handshake: refused or timeout
        await Bus.connect(no_cert)


async def test_services_connect_through_connect_bus_with_tls_files(
    nats_mtls: ServerProcess, pki: Pki
) -> None:
    """The path every service takes: CLI/env -> ServiceConfig -> connect_bus."""
    config = ServiceConfig(
        nats_url=_url(nats_mtls),
        nats_tls_ca=str(pki.ca),
        nats_tls_cert=str(pki.client_cert),
        nats_tls_key=str(pki.client_key),
    )
    a, b = await connect_bus(config, "svc-a"), await connect_bus(config, "svc-b")
    try:
        assert a.config.auth.tls_cert == str(pki.client_cert)
        await _round_trip(a, b)
    finally:
        await _closed(a, b)


async def test_connect_bus_takes_url_credentials(nats_users: ServerProcess) -> None:
    config = ServiceConfig(nats_url=_url(nats_users, f"alice:{URL_PASSWORD}@"))
    assert URL_PASSWORD not in repr(config)
    a, b = await connect_bus(config, "svc-a"), await connect_bus(config, "svc-b")
    try:
        await _round_trip(a, b)
    finally:
        await _closed(a, b)


def test_missing_tls_files_fail_at_configuration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        ServiceConfig(nats_tls_ca=str(tmp_path / "absent.pem"))
