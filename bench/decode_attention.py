"""Decode attention of the cpu backend, one layer's call: time and K/V read rate.

    flock /tmp/bench.lock taskset -c 0 python bench/decode_attention.py \
        [--rows 89] [--context 100,700] [--threads 1] [--base-lib PATH] [--kv-quantized]

R decode rows (one query each) with contexts drawn uniformly from the range (default: the
mixed workload's shape at a decode step, 89 rows over ~400 tokens), the shared checkpoint's
8 query and 4 KV heads of 64, blocks of 16 scattered through a 256 MB pool, 64 MB of other
memory written before every call (a decode step reads each layer's K/V once, from memory).
Prints the best time and the rate at which it read K and V; ``--hot`` leaves the K/V in
cache instead (the arithmetic alone). ``--base-lib`` also times another build of the kernel
library (e.g. main's, from ``~/.cache/epd-serve/kernels``), alternating call by call, and
checks both give the same bits. ``--kv-quantized`` also times the quantized caches' kernel
(csrc/epd_kvq8.c) over the same K/V quantized (``--kv-cache-dtype int8`` and ``fp8``),
alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.kernels import cpu_native, kv_quant  # noqa: E402
from services.kernels.cpu_attention import AttentionPlan  # noqa: E402
from services.kernels.cpu_backend import CpuBackend  # noqa: E402
from services.kernels.metadata import AttentionMetadata  # noqa: E402

HQ, HKV, D, BS, POOL = 8, 4, 64, 16, 16384


def inputs(rows: int, lo: int, hi: int, hot: bool):
    rng = random.Random(0)
    ctxs = [rng.randint(lo, hi) for _ in range(rows)]
    need = [-(-c // BS) for c in ctxs]
    ids = torch.randperm(POOL).tolist()
    tables = torch.zeros(rows, max(need), dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(list(range(n)) if hot else ids[used : used + n])
        used += n
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(ctxs),
        query_lens_cpu=[1] * rows,
        seq_lens_cpu=ctxs,
    )
    kc, vc = torch.randn(2, POOL, BS, HKV, D)
    return torch.randn(rows, HQ, D), kc, vc, meta, sum(ctxs) * HKV * D * 4 * 2


def call(lib, q, kc, vc, plan: AttentionPlan, ranges, fmt: str | None = None):
    """The kernel over the plan's rows, split over threads as the backend splits them
    (``fmt``: a quantized cache's, int8 or fp8)."""
    p = cpu_native.ptr
    out = torch.empty_like(q)
    kernel = lib.epd_par_decode_attention_q8 if fmt else lib.epd_par_decode_attention
    rc = kernel(
        p(out),
        p(q),
        p(kc),
        p(vc),
        p(plan.tables),
        plan.tables.stride(0),
        p(plan.lens),
        p(plan.rows),
        p(plan.seqs),
        HQ,
        HKV,
        D,
        BS,
        D**-0.5,
        *((fmt == "fp8",) if fmt else ()),
        *cpu_native.bounds(ranges),
    )
    assert rc == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=89)
    ap.add_argument("--context", default="100,700", help="lo,hi tokens")
    ap.add_argument("--threads", type=int, default=1, help="rows split as the backend does")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--base-lib", default="")
    ap.add_argument("--kv-quantized", action="store_true", help="also int8 and fp8 caches")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.context.split(","))
    q, kc, vc, meta, nbytes = inputs(args.rows, lo, hi, args.hot)
    be = CpuBackend.create()
    plan = AttentionPlan(meta, kc, HQ)
    ranges = be._split(plan.num_rows, 8)
    ways = {"this build": lambda: call(be.lib, q, kc, vc, plan, ranges)}
    read = {"this build": nbytes}
    for fmt in ("int8", "fp8") if args.kv_quantized else ():
        k8, v8 = kv_quant.quantize(kc, fmt), kv_quant.quantize(vc, fmt)
        ways[f"{fmt} cache"] = lambda k8=k8, v8=v8, fmt=fmt: call(
            be.lib, q, k8, v8, plan, ranges, fmt
        )
        read[f"{fmt} cache"] = nbytes * kv_quant.row_width(D) // (4 * D)
    if args.base_lib:
        base = ctypes.CDLL(args.base_lib)
        res, types = cpu_native._SIGNATURES["epd_par_decode_attention"]
        base.epd_par_decode_attention.restype, base.epd_par_decode_attention.argtypes = res, types
        ways["base"] = lambda: call(base, q, kc, vc, plan, ranges)
        read["base"] = nbytes
        print(
            f"the same bits as the base build: {torch.equal(ways['this build'](), ways['base']())}"
        )
    sweep = torch.empty(16 << 20)
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.rounds):
        for name, fn in ways.items():
            if not args.hot:
                sweep.add_(1.0)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(
        f"{args.rows} rows over {lo}-{hi} tokens, {args.threads} thread(s)"
        f"{', K/V in cache' if args.hot else ''}:"
    )
    for name, t in best.items():
        print(f"  {name}: {t * 1e3:.2f} ms, {read[name] / t / 1e9:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
