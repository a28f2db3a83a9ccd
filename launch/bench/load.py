"""When requests start: Poisson (gamma) arrivals under a concurrency cap."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sized
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def gap_stream(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless seconds between successive request starts, with mean ``1 / rate``.

    Gaps are gamma-distributed with shape ``burstiness`` and scale ``1 / (rate * burstiness)``
    (vLLM's convention): 1.0 is a Poisson process, below 1 burstier, above 1 more regular.
    An infinite rate sends everything at once (the concurrency cap then paces the run).
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0 (got {rate}, {burstiness})")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return (rng.gammavariate(burstiness, scale) for _ in itertools.count())


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """The first ``n`` gaps of ``gap_stream``."""
    return list(itertools.islice(gap_stream(rate, burstiness, seed), n))


async def run_load(
    items: Iterable[T],
    send: Callable[[T], Awaitable[R]],
    gaps: Iterable[float],
    max_concurrency: int | None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    *,
    duration_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_done: Callable[[R], None] | None = None,
) -> list[R]:
    """Start ``send(item)`` for each item after its gap; at most ``max_concurrency`` in flight.

    A request whose arrival comes while the cap is reached waits for a slot (as a client
    pool would); results are in the order the requests started. With ``duration_s`` no
    request starts once that long has passed since the first (``items`` and ``gaps`` may
    then be endless: ``itertools.cycle``, ``gap_stream``). ``on_done`` sees each result as
    it completes (a progress bar).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if isinstance(items, Sized) and isinstance(gaps, Sized) and len(items) != len(gaps):
        raise ValueError(f"{len(items)} items but {len(gaps)} gaps")
    slots = asyncio.Semaphore(max_concurrency or 2**30)

    async def one(item: T, held: bool) -> R:
        if not held:
            await slots.acquire()
        try:
            result = await send(item)
        finally:
            slots.release()
        if on_done is not None:
            on_done(result)
        return result

    tasks: list[asyncio.Task[R]] = []
    start = clock()
    for item, gap in zip(items, gaps, strict=False):
        if gap > 0:
            await sleep(gap)
        # Back-to-back arrivals wait for their slot here, so an endless list under a cap
        # never piles up tasks; spaced arrivals wait inside their task, keeping the schedule.
        held = gap == 0 and max_concurrency is not None
        if held:
            await slots.acquire()
        if duration_s is not None and clock() - start >= duration_s:
            if held:
                slots.release()
            break
        tasks.append(asyncio.create_task(one(item, held)))
    return list(await asyncio.gather(*tasks))
