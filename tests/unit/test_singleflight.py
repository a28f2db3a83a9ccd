"""Concurrent callers of one key share a single computation."""

from __future__ import annotations

import asyncio

import pytest

from services.singleflight import SingleFlight


async def test_ten_concurrent_callers_compute_once() -> None:
    group: SingleFlight[str, int] = SingleFlight()
    release = asyncio.Event()
    calls = 0

    async def compute() -> int:
        nonlocal calls
        calls += 1
        await release.wait()
        return 42

    waiters = [asyncio.create_task(group.do("k", compute)) for _ in range(10)]
    await asyncio.wait_for(_joined(group, "k", 10), 5)
    assert group.inflight("k")
    release.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [42] * 10
    assert calls == 1
    assert not group.inflight("k") and group.waiters("k") == 0
    assert await group.do("k", compute) == 42 and calls == 2  # finished keys recompute


async def test_exception_reaches_every_waiter() -> None:
    group: SingleFlight[str, int] = SingleFlight()

    async def boom() -> int:
        await asyncio.sleep(0)
        raise RuntimeError("encoder down")

    results = await asyncio.gather(*(group.do("k", boom) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_cancelled_caller_does_not_cancel_the_others() -> None:
    group: SingleFlight[str, str] = SingleFlight()
    release = asyncio.Event()

    async def compute() -> str:
        await release.wait()
        return "done"

    first = asyncio.create_task(group.do("k", compute))
    second = asyncio.create_task(group.do("k", compute))
    await asyncio.wait_for(_joined(group, "k", 2), 5)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    release.set()
    assert await asyncio.wait_for(second, 5) == "done"


async def _joined(group: SingleFlight[str, object], key: str, n: int) -> None:
    """Yield to the loop until ``n`` callers wait on ``key`` (bounded by the caller)."""
    while group.waiters(key) < n:
        await asyncio.sleep(0)
