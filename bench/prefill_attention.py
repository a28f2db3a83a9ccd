"""Prefill/extend attention of the cpu backend, kernel against kernel, one layer's call.

    flock /tmp/bench.lock taskset -c 0 python bench/prefill_attention.py

For each shape (query rows x context, the shared checkpoint's 8 query heads, 4 KV heads of
64, blocks of 16 scattered through the pool) times the three ways ``cpu_attention`` can
serve a prefill chunk, alternating round by round, and prints each one's best time: the
per-row kernel (``epd_decode_attention``), the tile kernel (``epd_extend_attention``) and
torch's block gather + SDPA (``torch_backend``). One thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.kernels import cpu_attention  # noqa: E402
from services.kernels import torch_backend as ref  # noqa: E402
from services.kernels.cpu_backend import CpuBackend  # noqa: E402
from services.kernels.metadata import AttentionMetadata  # noqa: E402

SHAPES = [
    (128, 128),
    (512, 512),
    (1024, 1024),
    (2000, 2000),
    (4000, 4000),
    (8, 512),
    (16, 2000),
    (64, 1024),
    (512, 2000),
    (1000, 4000),
]


def make_inputs(q: int, ctx: int, hq: int, hkv: int, d: int, bs: int = 16):
    """One sequence's chunk of q rows at the end of a ctx-token context."""
    gen = torch.Generator().manual_seed(q * 7 + ctx)
    nblk = -(-ctx // bs)
    pool = 2 * nblk + 8
    table = torch.randperm(pool, generator=gen)[:nblk].to(torch.int32)[None]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, q], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.zeros(q, dtype=torch.int64),
        max_query_len=q,
        max_seq_len=ctx,
        query_lens_cpu=[q],
        seq_lens_cpu=[ctx],
    )
    kc = torch.randn(pool, bs, hkv, d, generator=gen)
    vc = torch.randn(pool, bs, hkv, d, generator=gen)
    return torch.randn(q, hq, d, generator=gen), kc, vc, meta


def way(be: CpuBackend, name: str):
    """The attention call serving the chunk the named way."""
    if name == "sdpa":
        return ref.attention

    def call(query, kc, vc, meta, scale):
        names = ("TILE_MIN_ROWS", "ROW_EXTEND_MAX")  # SDPA never
        old = [getattr(cpu_attention, n) for n in names]
        big = 1 << 30
        limits = (big, big) if name == "row" else (2, big)
        try:
            for n, v in zip(names, limits, strict=True):
                setattr(cpu_attention, n, v)
            be._plan = (None, None)  # plan anew under these limits
            return be.attention(query, kc, vc, meta, scale)
        finally:
            for n, v in zip(names, old, strict=True):
                setattr(cpu_attention, n, v)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", default="8,4,64", help="query heads, KV heads, head size")
    ap.add_argument("--shapes", default="", help="e.g. 512x512,16x2000 (rows x context)")
    ap.add_argument("--ways", default="row,tile,sdpa")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    be = CpuBackend.create()
    names = args.ways.split(",")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    print(f"threads={args.threads} heads={hq}/{hkv}x{d}; best of {args.rounds}, ms per call")
    print(f"{'rows':>6} {'ctx':>6} " + " ".join(f"{n:>9}" for n in names) + "  tile/best-other")
    for q, ctx in shapes or SHAPES:
        query, kc, vc, meta = make_inputs(q, ctx, hq, hkv, d)
        want = ref.attention(query, kc, vc, meta, d**-0.5)
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            for n in names:
                t0 = time.perf_counter()
                got = way(be, n)(query, kc, vc, meta, d**-0.5)
                best[n] = min(best[n], time.perf_counter() - t0)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
        other = min((best[n] for n in names if n != "tile"), default=float("nan"))
        ratio = other / best["tile"] if "tile" in best else float("nan")
        cells = " ".join(f"{best[n] * 1e3:9.2f}" for n in names)
        print(f"{q:6d} {ctx:6d} {cells}  {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
