"""The embedding store and the answer store against Redis that demands a password, over
TLS (server and client certificates), and found through Sentinel: every client comes from
``services.redis_client``; a wrong password is a clear error (the embedding store reads
it as a miss, as it does any Redis failure) and no password reaches a log line."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import torch
from redis.exceptions import AuthenticationError, ConnectionError

from cache_svc.answers import AnswerStore
from cache_svc.index import DIM
from launch.localstack import ServerProcess, start_redis
from services.config import ServiceConfig
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig
from services.redis_client import redis_client
from tests.integration.secure_servers import Pki, make_pki, server_context, start_sentinel
from tests.integration.secure_servers import tls_front as tls_front_for

PASSWORD = "r3d!s@pw%x"


@pytest.fixture(scope="module")
def redis_pw() -> Iterator[ServerProcess]:
    with start_redis(password=PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def tls_front(redis_pw: ServerProcess, pki: Pki) -> AsyncIterator[int]:
    """A TLS listener in front of ``redis_pw`` that requires a client certificate."""
    async with tls_front_for(server_context(pki, verify_clients=True), redis_pw.port) as port:
        yield port


def _url(port: int, password: str = PASSWORD, scheme: str = "redis", query: str = "") -> str:
    return f"{scheme}://:{quote(password, safe='')}@127.0.0.1:{port}/0{query}"


async def _store_round_trip(url: str) -> None:
    store = EmbeddingStore.from_config(EmbeddingStoreConfig(url=url, op_timeout_s=2.0))
    try:
        tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert await store.put("fp", "a" * 64, tensor)
        assert torch.equal(await store.get("fp", "a" * 64), tensor)
    finally:
        await store.close()


def test_the_fixture_url_carries_the_password(redis_pw: ServerProcess) -> None:
    assert redis_pw.url == _url(redis_pw.port)
    assert PASSWORD not in repr(ServiceConfig(redis_url=redis_pw.url))
    assert quote(PASSWORD, safe="") not in repr(ServiceConfig(redis_url=redis_pw.url))


async def test_embedding_store_with_a_password(
    redis_pw: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await _store_round_trip(redis_pw.url)
    bad = EmbeddingStore.from_config(EmbeddingStoreConfig(url=_url(redis_pw.port, "b4d-pw-77")))
    try:
        assert await bad.get("fp", "a" * 64) is None  # Redis trouble is a miss ...
    finally:
        await bad.close()
    assert "AuthenticationError" in caplog.text  # ... logged with Redis's reason ...
    assert "b4d-pw-77" not in caplog.text and quote(PASSWORD, safe="") not in caplog.text


async def test_a_wrong_password_is_a_clear_error(redis_pw: ServerProcess) -> None:
    for password in ("wrong", ""):
        url = _url(redis_pw.port, password) if password else f"redis://127.0.0.1:{redis_pw.port}"
        client = redis_client(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:  # a wrong password: WRONGPASS at connect; none: NOAUTH on the first command
            with pytest.raises(AuthenticationError):
                await client.ping()
        finally:
            await client.aclose()


async def test_answer_store_with_a_password(redis_pw: ServerProcess) -> None:
    store = AnswerStore(redis_pw.url, op_timeout_s=2.0, follow_block_ms=50)
    try:
        start = await store.log_position()
        vector = np.ones(DIM, np.float32) / np.sqrt(DIM)
        key = await store.put("fp", "exact-1", "why?", vector, b"because", "", ttl_s=60)
        assert await store.exact("exact-1") == key
        [entry] = await store.entries([key])
        assert (entry.question, entry.answer) == ("why?", b"because")
        _, changes = await store.follow(start)  # the feed client authenticates too
        assert [c.key for c in changes if c.added] == [key]
    finally:
        await store.delete([key])
        await store.close()


async def test_rediss_with_ca_and_client_certificate(tls_front: int, pki: Pki) -> None:
    query = f"?ssl_ca_certs={pki.ca}&ssl_certfile={pki.client_cert}&ssl_keyfile={pki.client_key}"
    await _store_round_trip(_url(tls_front, scheme="rediss", query=query))


@pytest.mark.parametrize("which", ["untrusted CA", "no client certificate"])
async def test_rediss_refuses_what_it_should(tls_front: int, pki: Pki, which: str) -> None:
    if which == "untrusted CA":
        query = f"?ssl_ca_certs={pki.other_ca}&ssl_certfile={pki.client_cert}"
        query += f"&ssl_keyfile={pki.client_key}"
    else:
        query = f"?ssl_ca_certs={pki.ca}"
    client = redis_client(
        _url(tls_front, scheme="rediss", query=query),
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
    )
    try:
        with pytest.raises(ConnectionError):
            await client.ping()
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def sentinel(redis_pw: ServerProcess) -> Iterator[ServerProcess]:
    server = start_sentinel(redis_pw, "mymaster", PASSWORD)
    yield server
    server.stop()


async def test_sentinel_url_finds_the_master(sentinel: ServerProcess, redis_pw: ServerProcess):
    url = f"redis+sentinel://:{quote(PASSWORD, safe='')}@{sentinel.url}/mymaster/0"
    await _store_round_trip(url)
    store = AnswerStore(url, op_timeout_s=2.0)
    try:
        key = await store.put("fp", "exact-s", "", np.zeros(DIM, np.float32), b"a", "", 60)
        assert await store.exact("exact-s") == key
        await store.delete([key])
    finally:
        await store.close()


def test_a_tls_file_named_in_the_url_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        ServiceConfig(redis_url=f"rediss://h:6380/0?ssl_ca_certs={tmp_path / 'absent.pem'}")
