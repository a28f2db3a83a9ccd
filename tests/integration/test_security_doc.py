"""docs/security.md's samples, run as written. The nats-server block: every role,
connected with its password and client certificate over TLS, may publish and subscribe
exactly what the doc's table says (subjects built by services/bus/subjects.py, so a
renamed subject fails here), is refused outside it, and request/reply across roles works.
The Redis ACL line: both stores work under it, and it denies keys outside ``epd:*``."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from redis.exceptions import NoPermissionError

from cache_svc.answers import AnswerStore
from cache_svc.index import DIM
from launch.localstack import ServerProcess, start_nats, start_redis
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.auth import NatsAuth
from services.bus.connection import Bus, BusConfig, Incoming
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig
from services.redis_client import redis_client
from tests.integration.secure_servers import Pki, make_pki

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
ROLES = ("gateway", "encoder", "prefill", "decode", "cache")
FP, ID = "fp0123", "x-1"

# role -> (may publish, may subscribe); the doc's table, written with subjects.py.
ALLOWED = {
    "gateway": (
        [
            subjects.encoder(FP, ID),
            subjects.blob(ID),
            subjects.prefill(FP, ID),
            subjects.CACHE_LOOKUP,
            subjects.CACHE_STORE,
            subjects.ABORT,
            subjects.heartbeat("gateway", ID),
        ],
        [subjects.out(ID), subjects.heartbeat_wildcard("decode"), "_INBOX.abc.*"],
    ),
    "encoder": (
        [subjects.blob(ID), subjects.heartbeat("encode", ID)],
        [subjects.encoder(FP, ID), subjects.blob(ID)],
    ),
    "prefill": (
        [
            subjects.decode(FP, ID),
            subjects.kv(ID),
            subjects.out(ID),
            subjects.heartbeat("prefill", ID),
        ],
        [subjects.prefill(FP, ID), subjects.blob(ID), subjects.ABORT],
    ),
    "decode": (
        [subjects.out(ID), subjects.heartbeat("decode", ID)],
        [subjects.decode(FP, ID), subjects.kv(ID), subjects.ABORT],
    ),
    "cache": ([subjects.heartbeat("cache", ID)], [subjects.CACHE_LOOKUP, subjects.CACHE_STORE]),
}
# One step outside the table per role: (publish, subscribe).
DENIED = {
    "gateway": (subjects.kv(ID), subjects.prefill(FP, ID)),
    "encoder": (subjects.prefill(FP, ID), subjects.kv(ID)),
    "prefill": (subjects.heartbeat("decode", ID), subjects.out(ID)),
    "decode": (subjects.kv(ID), subjects.blob(ID)),
    "cache": (subjects.ABORT, subjects.heartbeat_wildcard("decode")),
}


def _doc_block(marker: str) -> str:
    block = re.search(rf"<!-- {marker} -->\n```text\n(.*?)```", DOC.read_text(), re.S)
    assert block, f"docs/security.md lost its {marker} block"
    return block.group(1)


def _doc_config(pki: Pki) -> str:
    return _doc_block("nats-server.conf").replace("/etc/nats/tls/", f"{pki.ca.parent}/")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def locked_nats(pki: Pki) -> Iterator[ServerProcess]:
    names = [f"EPD_NATS_{role.upper()}_PASSWORD" for role in ROLES]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: f"pw-{name.lower()}" for name in names})  # the server reads them
    try:
        with start_nats(extra_config=_doc_config(pki)) as server:
            yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.fixture
async def connect(locked_nats: ServerProcess, pki: Pki) -> AsyncIterator:
    buses: list[Bus] = []

    async def as_role(role: str) -> Bus:
        password = f"pw-epd_nats_{role}_password"
        auth = NatsAuth(
            tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key)
        )
        url = f"tls://{role}:{password}@127.0.0.1:{locked_nats.port}"
        buses.append(await Bus.connect(BusConfig(servers=(url,), name=role, auth=auth)))
        return buses[-1]

    yield as_role
    for bus in buses:
        await bus.close()


async def _noop(msg: Incoming) -> None:
    return None


@pytest.mark.parametrize("role", ROLES)
async def test_each_role_may_do_what_the_table_says_and_no_more(
    connect, role: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="services.bus.connection")
    bus = await connect(role)
    publishes, subscribes = ALLOWED[role]
    for subject in subscribes:
        await bus.subscribe(subject, _noop)
    for subject in publishes:
        await bus.publish(subject, b"")
    denied_pub, denied_sub = DENIED[role]
    await bus.subscribe(denied_sub, _noop)
    await bus.publish(denied_pub, b"")
    await bus.flush()
    expected = [
        f'permissions violation for subscription to "{denied_sub}"',
        f'permissions violation for publish to "{denied_pub}"',
    ]
    # The server reports violations in order, but nats-py hands them to the error
    # callback in tasks of their own: wait (bounded) for the two that must come; any
    # violation of an allowed action was reported before them.
    deadline = asyncio.get_running_loop().time() + 5.0
    while not all(e in caplog.text.lower() for e in expected):
        assert asyncio.get_running_loop().time() < deadline, caplog.text
        await asyncio.sleep(0.01)
    assert caplog.text.lower().count("permissions violation") == 2, caplog.text


async def test_request_reply_across_roles(connect) -> None:
    gateway, prefill = await connect("gateway"), await connect("prefill")

    async def admit(msg: Incoming) -> None:
        await msg.respond(bus_pb2.Heartbeat(instance_id="p-1", running=1))

    await prefill.subscribe(subjects.prefill(FP, "p-1"), admit)
    await prefill.flush()
    reply = await gateway.request(
        subjects.prefill(FP, "p-1"), bus_pb2.Abort(), bus_pb2.Heartbeat, 2.0
    )
    assert reply.instance_id == "p-1"


async def test_the_redis_acl_line_runs_both_stores() -> None:
    rule = _doc_block("redis acl").split()
    assert rule[:2] == ["user", "epd"]
    with start_redis(password="admin-pw") as server:
        admin = redis_client(server.url)
        await admin.execute_command(
            "ACL", "SETUSER", "epd", *[r.replace(">PASSWORD", ">acl-pw") for r in rule[2:]]
        )
        await admin.aclose()
        url = f"redis://epd:acl-pw@127.0.0.1:{server.port}/0"
        store = EmbeddingStore.from_config(EmbeddingStoreConfig(url=url, op_timeout_s=2.0))
        assert await store.put("fp", "b" * 64, torch.ones(2, 3))
        assert torch.equal(await store.get("fp", "b" * 64), torch.ones(2, 3))
        await store.close()
        answers = AnswerStore(url, op_timeout_s=2.0, follow_block_ms=50)
        try:
            start = await answers.log_position()
            key = await answers.put("fp", "x", "q", np.ones(DIM, np.float32), b"a", "t", 60)
            assert await answers.exact("x") == key and len((await answers.follow(start))[1]) == 1
            assert [c.key async for c in answers.scan()] == [key]
            assert await answers.evict(60, 10, "t", 5) == 0
            await answers.delete([key])
            with pytest.raises(NoPermissionError):
                await answers.redis.get("not-epd:key")
        finally:
            await answers.close()
