"""An encoder that keeps finishing tower passes is busy, not stuck: an image queued behind
others waits on it past the stall timeout (up to the request's deadline); one whose passes
stopped is left for another encoder. Heartbeats carry the encoder's pass count as steps."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gateway.attempt import WorkerLost, while_alive
from gateway.encode import ImageEncoder
from protos.epd_pb import bus_pb2
from services.bus.heartbeat import InstanceRegistry
from services.microbatch import MicroBatcher
from tests.helpers.stall_watch import Clock, Watch

STALL_S = 30.0


def _encoder(clock: Clock, steps_then: int, steps_now: int) -> ImageEncoder:
    """An encoder first heard 40 s ago with ``steps_then`` passes, now ``steps_now``."""
    registry = InstanceRegistry(None, ["encode"], expiry_s=1e9, clock=clock)
    clock.offset = -40.0
    registry.record(bus_pb2.Heartbeat(role="encode", instance_id="e0", steps=steps_then))
    clock.offset = 0.0
    registry.record(bus_pb2.Heartbeat(role="encode", instance_id="e0", steps=steps_now))
    return ImageEncoder(None, "fp", 10.0, STALL_S, None, Watch(registry))


def test_an_image_queued_on_a_working_encoder_is_waited_for():
    encoder = _encoder(Clock(), steps_then=1, steps_now=9)
    asked = time.monotonic() - 2 * STALL_S  # asked long ago; a pass finished just now
    assert encoder._stalled("e0", asked) is None


def test_an_encoder_whose_passes_stopped_is_left():
    encoder = _encoder(Clock(), steps_then=4, steps_now=4)  # beats, but no pass in 40 s
    with pytest.raises(WorkerLost, match="no tower pass for 30s"):
        raise encoder._stalled("e0", time.monotonic() - 2 * STALL_S)
    # A fresh ask is not a stall yet, whatever the encoder did before it.
    assert encoder._stalled("e0", time.monotonic()) is None


async def test_the_wait_ends_with_the_stall_not_with_the_reply():
    never = asyncio.get_running_loop().create_future()
    encoder = _encoder(Clock(), steps_then=4, steps_now=4)
    asked = time.monotonic() - 2 * STALL_S
    with pytest.raises(WorkerLost, match="encode instance e0: no embedding"):
        await while_alive(
            never,
            lambda: True,
            lambda: WorkerLost("encode", "e0", "gone"),
            stalled=lambda: encoder._stalled("e0", asked),
        )
    assert never.cancelled()


async def test_the_batcher_counts_its_passes_and_its_queue():
    started, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def encode(images: list) -> list[torch.Tensor]:  # the worker thread, held by the test
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
        return [torch.zeros(1) for _ in images]

    batcher = MicroBatcher(encode)
    first = asyncio.ensure_future(batcher.submit("a"))
    await started.wait()  # "a" is in the tower: the next two queue behind it
    rest = [asyncio.ensure_future(batcher.submit(x)) for x in "bc"]
    await asyncio.sleep(0)  # one loop turn: both submit tasks run up to their wait
    assert (batcher.batches, batcher.waiting) == (0, 2)
    release.set()
    await asyncio.gather(first, *rest)
    assert (batcher.batches, batcher.waiting) == (2, 0)  # "a" alone, then "b" and "c"


def test_never_sooner_than_the_bus_timeout():
    """One pass over a huge image (or its decode) finishes no pass for a while: an encoder
    is given at least the bus timeout, as before pass counts existed."""
    encoder = _encoder(Clock(), steps_then=4, steps_now=4)
    asked = time.monotonic() - 2 * STALL_S  # the last pass finished 40 s ago
    encoder.timeout_s = 3 * STALL_S
    assert encoder._stalled("e0", asked) is None
    encoder.timeout_s = 35.0
    assert encoder._stalled("e0", asked) is not None
