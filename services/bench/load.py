"""When requests start: Poisson (gamma) arrivals under a concurrency cap."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between successive request starts: ``n`` gaps of mean ``1 / rate``.

    Gaps are gamma-distributed with shape ``burstiness`` and scale ``1 / (rate * burstiness)``
    (vLLM's convention): 1.0 is a Poisson process, below 1 burstier, above 1 more regular.
    An infinite rate sends everything at once (the concurrency cap then paces the run).
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0 (got {rate}, {burstiness})")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


async def run_load(items: Sequence[T], send: Callable[[T], Awaitable[R]], gaps: Sequence[float],
                   max_concurrency: int | None,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> list[R]:  # fmt: skip
    """Start ``send(item)`` for each item after its gap; at most ``max_concurrency`` in flight.

    A request whose arrival comes while the cap is reached waits for a slot (as a client
    pool would); results are in the order of ``items``.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency or len(items) or 1)

    async def one(item: T) -> R:
        async with slots:
            return await send(item)

    tasks: list[asyncio.Task[R]] = []
    for item, gap in zip(items, gaps, strict=True):
        if gap > 0:
            await sleep(gap)
        tasks.append(asyncio.create_task(one(item)))
    return list(await asyncio.gather(*tasks))
