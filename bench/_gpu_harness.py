"""Benchmark helper: shapes, tolerances, PASS/FAIL bookkeeping and timers for the GPU check."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from triton.testing import do_bench

DEV = torch.device("cuda")
HQ, HKV, D, PAGE = 32, 8, 128, 16
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


class Run:
    """PASS/FAIL bookkeeping and the time guard."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget, self.failed = time.monotonic(), budget_s, []

    def time_left(self, section: str) -> bool:
        left = self.budget - (time.monotonic() - self.start)
        if left <= 0:
            print(f"SKIP {section}: time budget of {self.budget:.0f}s spent", flush=True)
        return left > 0

    def check(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            print(f"PASS {name}", flush=True)
        except Exception as e:  # report and keep going: one failure must not hide others
            self.failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)


def bench_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)
