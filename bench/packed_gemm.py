"""oneDNN's fp32 GEMM on the column-major weights models keep, against a packed copy.

    flock /tmp/bench.lock taskset -c 0 python bench/packed_gemm.py [--threads 1]

The cpu backend multiplies past the GEMV's 32 rows through oneDNN (on non-Intel CPUs), on
copies of the weights packed once (``services/kernels/cpu_gemm.py``). For the peers
Llama's matrices and LM head at several row counts: GFLOP/s with the column-major weight
(oneDNN re-blocks it on every call), with a copy packed for 64 rows and one packed for
2,048 rows, interleaved, best of ``--reps``; and whether the packed products are bitwise
the plain ones.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408), (32000, 512)]  # (out, in)
ROWS = [33, 64, 89, 256, 2048]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def best(fn, reps: int) -> float:
    fn()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s); GFLOP/s: column-major / packed for 64 / for 2048 rows")
    for n, k in SHAPES:
        w = torch.randn(k, n).t()  # W [n, k] stored as W^T
        packs = {
            rows: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
            for rows in (64, 2048)
        }
        for m in ROWS:
            x = torch.randn(m, k)
            plain = linear(x, w)
            flops = 2 * m * k * n
            rates, same = [], True
            for weight in (w, *packs.values()):
                same &= torch.equal(linear(x, weight), plain)
                rates.append(
                    flops / best(lambda x=x, weight=weight: linear(x, weight), args.reps) / 1e9
                )
            print(
                f"  {m:5d} x {k:5d} x {n:5d}: "
                + " / ".join(f"{r:6.1f}" for r in rates)
                + f"  same bits: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
