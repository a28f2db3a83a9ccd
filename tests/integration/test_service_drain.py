"""The service skeleton's drain, on real NATS: a draining instance says so in every
heartbeat and stays live while its work finishes; new work is refused with a retryable
UNAVAILABLE; the first SIGTERM drains a process, a second one ends it at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.heartbeat import InstanceRegistry
from tests.helpers.held_service import HeldService, config, release_subject, work_subject

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def registry(bus) -> AsyncIterator[InstanceRegistry]:
    """Encoder heartbeats; an instance silent for 0.3 s (three beats) is gone."""
    reg = InstanceRegistry(bus, [subjects.ROLE_ENCODE], expiry_s=0.3)
    await reg.start()
    yield reg
    await reg.stop()


def state(registry: InstanceRegistry, iid: str) -> str:
    """One of serving, draining (live, but routers skip it) or gone."""
    if any(i.instance_id == iid for i in registry.live(subjects.ROLE_ENCODE)):
        return "serving"
    everyone = registry.live(subjects.ROLE_ENCODE, include_draining=True)
    return "draining" if any(i.instance_id == iid for i in everyone) else "gone"


def running(registry: InstanceRegistry, iid: str) -> int:
    live = registry.live(subjects.ROLE_ENCODE, include_draining=True)
    return next((i.load.running for i in live if i.instance_id == iid), -1)


async def ask(bus, iid: str, timeout_s: float = 30.0) -> bus_pb2.EncodeReply:
    return await bus.request(
        work_subject(iid), bus_pb2.EncodeRequest(), bus_pb2.EncodeReply, timeout_s
    )


async def draining_beats(bus, iid: str, count: int) -> list[bus_pb2.Heartbeat]:
    """The next ``count`` heartbeats of ``iid`` (the beats are the test's clock)."""
    sub, box = await bus.subscribe_queue(subjects.heartbeat(subjects.ROLE_ENCODE, iid))
    try:
        beats = []
        for _ in range(count):
            msg = await asyncio.wait_for(box.get(), timeout=5)
            beats.append(bus_pb2.Heartbeat.FromString(msg.data))
        return beats
    finally:
        await sub.unsubscribe()


async def test_draining_instance_is_announced_stays_live_and_refuses_new_work(
    nats_server, bus, registry
):
    iid = f"held-{uuid.uuid4().hex[:6]}"
    svc = HeldService(config(nats_server.url, iid, grace_s=30.0))
    await svc.start()
    stopping = None
    try:
        await registry.wait_for(lambda: state(registry, iid) == "serving", timeout_s=5)
        held = asyncio.create_task(ask(bus, iid))
        await registry.wait_for(lambda: running(registry, iid) == 1, timeout_s=5)

        stopping = asyncio.create_task(svc.stop())
        await registry.wait_for(lambda: state(registry, iid) == "draining", timeout_s=5)
        # Eight beats (0.8 s) outlast the 0.3 s expiry: only beating keeps it live.
        beats = await draining_beats(bus, iid, 8)
        assert all(b.draining and b.running == 1 for b in beats)
        assert state(registry, iid) == "draining" and not stopping.done()

        refused = await ask(bus, iid, timeout_s=5)
        assert refused.error.code == bus_pb2.ERROR_CODE_UNAVAILABLE
        assert "draining" in refused.error.message

        await bus.publish(release_subject(iid), b"")
        assert (await held).image_hash == "done"  # in-flight work finished, not dropped
        await asyncio.wait_for(stopping, timeout=10)
        await asyncio.wait_for(svc.stop(), timeout=1)  # a second stop: already done
    finally:
        svc.released.set()
        await (stopping or svc.stop())


async def test_work_still_running_at_the_end_of_the_grace_does_not_hold_the_stop(
    nats_server, bus, registry
):
    iid = f"held-{uuid.uuid4().hex[:6]}"
    svc = HeldService(config(nats_server.url, iid, grace_s=0.5))
    await svc.start()
    await registry.wait_for(lambda: state(registry, iid) == "serving", timeout_s=5)
    held = asyncio.create_task(ask(bus, iid, timeout_s=60))
    await registry.wait_for(lambda: running(registry, iid) == 1, timeout_s=5)
    both = asyncio.gather(svc.stop(), svc.stop())  # triggered twice: one shutdown
    # The grace (0.5 s) plus the bus's bounded wait for the stuck handler (5 s).
    await asyncio.wait_for(both, timeout=20)
    svc.released.set()  # let the abandoned handler task end
    held.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await held


def _spawn_held(nats_url: str, iid: str, grace_s: float, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tests.helpers.held_service", nats_url, iid, str(grace_s)]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


async def _exit_code(proc: subprocess.Popen, timeout_s: float) -> int:
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout=timeout_s)


async def test_sigterm_drains_the_process_and_it_exits_cleanly(
    nats_server, bus, registry, tmp_path
):
    iid = f"held-{uuid.uuid4().hex[:6]}"
    proc = _spawn_held(nats_server.url, iid, 60.0, tmp_path / "held.log")
    try:
        await registry.wait_for(lambda: state(registry, iid) == "serving", timeout_s=60)
        held = asyncio.create_task(ask(bus, iid))
        await registry.wait_for(lambda: running(registry, iid) == 1, timeout_s=5)
        proc.send_signal(signal.SIGTERM)
        await registry.wait_for(lambda: state(registry, iid) == "draining", timeout_s=5)
        assert proc.poll() is None  # still finishing its work
        await bus.publish(release_subject(iid), b"")
        assert (await held).image_hash == "done"
        assert await _exit_code(proc, timeout_s=15) == 0, (tmp_path / "held.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_a_second_signal_exits_at_once(nats_server, bus, registry, tmp_path):
    iid = f"held-{uuid.uuid4().hex[:6]}"
    proc = _spawn_held(nats_server.url, iid, 600.0, tmp_path / "held.log")
    try:
        await registry.wait_for(lambda: state(registry, iid) == "serving", timeout_s=60)
        held = asyncio.create_task(ask(bus, iid, timeout_s=60))
        await registry.wait_for(lambda: running(registry, iid) == 1, timeout_s=5)
        proc.send_signal(signal.SIGTERM)
        await registry.wait_for(lambda: state(registry, iid) == "draining", timeout_s=5)
        proc.send_signal(signal.SIGTERM)
        # Far inside the 600 s grace, with the work still held: it did not wait.
        assert await _exit_code(proc, timeout_s=10) == 128 + signal.SIGTERM
        assert "exiting now" in (tmp_path / "held.log").read_text()
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await held
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
