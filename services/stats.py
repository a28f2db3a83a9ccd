"""The one percentile definition: the benchmark client's reports, the dashboard's rolling
window and the bench scripts all use it, so their p50/p90/p99 agree on the same samples."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest
    ranks (numpy's default, as ``vllm bench serve`` reports); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
