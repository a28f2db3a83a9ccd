"""Bus request/reply against a real nats-server: replies, timeouts, no responders,
handler failures that leave the service alive, queue groups, concurrency, close."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from launch.localstack import free_port, start_nats
from protos.epd_pb import bus_pb2
from services.bus.connection import Bus, BusConfig, Incoming
from services.bus.errors import BusTimeout, BusUnavailable, NoResponders, RemoteError
from tests.integration.conftest import BusFactory


async def _echo_load(msg: Incoming) -> None:
    """Replies with a Heartbeat whose `running` is the request's plus one."""
    hb = msg.decode(bus_pb2.Heartbeat)
    if hb.instance_id == "boom":
        raise RuntimeError("handler exploded")
    await msg.respond(bus_pb2.Heartbeat(instance_id=hb.instance_id, running=hb.running + 1))


async def test_request_reply_typed(bus_factory: BusFactory) -> None:
    service, client = await bus_factory(name="svc"), await bus_factory(name="client")
    await service.subscribe("t.echo", _echo_load)
    await service.flush()
    reply = await client.request(
        "t.echo", bus_pb2.Heartbeat(instance_id="a", running=41), bus_pb2.Heartbeat, 2.0
    )
    assert reply.instance_id == "a" and reply.running == 42


async def test_request_times_out_with_a_clear_error(bus_factory: BusFactory) -> None:
    service, client = await bus_factory(), await bus_factory()

    async def never_answers(msg: Incoming) -> None:
        return None

    await service.subscribe("t.silent", never_answers)
    await service.flush()
    started = time.monotonic()
    with pytest.raises(BusTimeout, match="t.silent"):
        await client.request("t.silent", bus_pb2.Abort(), bus_pb2.Abort, 0.2)
    assert time.monotonic() - started < 2.0
    with pytest.raises(BusTimeout):  # an expired deadline never reaches the wire
        await client.request("t.silent", bus_pb2.Abort(), bus_pb2.Abort, 0.0)


async def test_no_responders_fails_fast(bus: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(NoResponders, match="t.nobody"):
        await bus.request("t.nobody", bus_pb2.Abort(), bus_pb2.Abort, 5.0)
    assert time.monotonic() - started < 2.0


async def test_handler_exception_answers_an_error_and_keeps_serving(
    bus_factory: BusFactory, caplog: pytest.LogCaptureFixture
) -> None:
    service, client = await bus_factory(), await bus_factory()
    await service.subscribe("t.echo", _echo_load)
    await service.flush()
    with pytest.raises(RemoteError, match="handler exploded"):
        await client.request("t.echo", bus_pb2.Heartbeat(instance_id="boom"), bus_pb2.Heartbeat, 2)
    with pytest.raises(RemoteError, match="MessageDecodeError"):
        await client.request("t.echo", b"\xff\xff\xff", bus_pb2.Heartbeat, 2.0)
    await client.publish("t.echo", bus_pb2.Heartbeat(instance_id="boom"))  # no reply wanted
    reply = await client.request(
        "t.echo", bus_pb2.Heartbeat(instance_id="ok", running=1), bus_pb2.Heartbeat, 2.0
    )
    assert reply.running == 2
    assert "bus handler failed" in caplog.text


async def test_queue_group_delivers_each_message_once(bus_factory: BusFactory) -> None:
    client = await bus_factory()
    seen: dict[str, int] = {"a": 0, "b": 0}
    for name in seen:
        replica = await bus_factory(name=name)

        async def handle(msg: Incoming, name: str = name) -> None:
            seen[name] += 1
            await msg.respond(bus_pb2.Abort(request_id=name))

        await replica.subscribe("t.work", handle, queue="workers")
        await replica.flush()
    for _ in range(20):
        await client.request("t.work", bus_pb2.Abort(), bus_pb2.Abort, 2.0)
    assert sum(seen.values()) == 20


async def test_max_concurrency_runs_handlers_in_parallel(bus_factory: BusFactory) -> None:
    service, client = await bus_factory(), await bus_factory()
    in_flight, all_in = 0, asyncio.Event()

    async def rendezvous(msg: Incoming) -> None:
        nonlocal in_flight
        in_flight += 1
        if in_flight == 4:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 2.0)  # deadlocks if handlers ran one by one
        await msg.respond(bus_pb2.Abort())

    await service.subscribe("t.par", rendezvous, max_concurrency=4)
    await service.flush()
    calls = [client.request("t.par", bus_pb2.Abort(), bus_pb2.Abort, 3.0) for _ in range(4)]
    assert len(await asyncio.gather(*calls)) == 4


async def test_close_is_idempotent_and_final(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await bus.subscribe("t.echo", _echo_load)
    await bus.close()
    await bus.close()
    with pytest.raises(BusUnavailable):
        await bus.publish("t.echo", bus_pb2.Abort())


async def test_connect_to_a_dead_server_raises_within_the_timeout() -> None:
    config = BusConfig(servers=(f"nats://127.0.0.1:{free_port()}",), connect_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="cannot connect"):
        await Bus.connect(config)
    assert time.monotonic() - started < 3.0


async def test_reconnects_and_resubscribes_after_a_server_restart() -> None:
    server = start_nats()
    config = BusConfig(servers=(server.url,), reconnect_wait_s=0.05, drain_timeout_s=1.0)
    service, client = await Bus.connect(config), await Bus.connect(config)
    try:
        await service.subscribe("t.echo", _echo_load)
        await service.flush()
        server.stop()
        server = start_nats(server.port)
        for bus in (service, client):
            await asyncio.wait_for(_until(lambda b=bus: b.is_connected), 10)
        await service.flush()  # the subscription was replayed on reconnect
        reply = await client.request(
            "t.echo", bus_pb2.Heartbeat(instance_id="r", running=1), bus_pb2.Heartbeat, 2.0
        )
        assert reply.running == 2
    finally:
        await client.close()
        await service.close()
        server.stop()


async def _until(cond: Callable[[], bool]) -> None:
    """Poll a condition (callers bound this with a timeout)."""
    while not cond():
        await asyncio.sleep(0.01)
