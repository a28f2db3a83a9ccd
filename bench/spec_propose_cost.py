"""Cost of one EAGLE-3 / P-EAGLE ``propose`` (drafting alone, no target), per head.

    python -m bench.spec_propose_cost [--heads DIR] [--k 3 5 7] [--batch 1 8]
        [--proposes 40] [--rounds 3] [--profile]

Loads the benchmark's trained heads (``bench/spec_decode.py`` builds them under
``~/.cache/epd-serve/spec-bench/<version>/``), gives each of ``batch`` requests a 64-row
prompt, then times ``proposes`` rounds in which every request brings 1-3 new target rows
(random values: the cost does not depend on them) as after a verification, and prints the
median ``propose`` two ways, in interleaved rounds: ``native``, the head's norms and
rotary through the cpu backend, as the engine runs it, and ``torch``, op by op in torch.
``--profile`` adds torch's operator table (native).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.engine.spec.eagle import Eagle3Proposer
from services.engine.spec.proposer import ProposeInput
from services.kernels.cpu_backend import CpuBackend
from services.models.eagle3 import Eagle3Head

HEADS = Path.home() / ".cache" / "epd-serve" / "spec-bench" / "v2"


def timed_proposes(prop: Eagle3Proposer, batch: int, k: int, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` proposes after a 64-row prompt per request."""
    c = prop.head.cfg
    width = len(c.aux_layer_ids) * c.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    ids = [
        torch.randint(0, c.vocab_size, (64 + 4 * rounds,), generator=gen).tolist()
        for _ in range(batch)
    ]
    lens = [64] * batch
    prop.propose(
        [ProposeInput(f"r{i}", ids[i][:64], torch.randn(63, width)) for i in range(batch)], k
    )
    seconds = []
    for s in range(rounds):
        inputs = []
        for i in range(batch):
            m = 1 + (s + i) % 3  # accepted drafts + 1, as after a verification
            lens[i] += m
            inputs.append(ProposeInput(f"r{i}", ids[i][: lens[i]], torch.randn(m, width)))
        t0 = time.perf_counter()
        prop.propose(inputs, k)
        seconds.append(time.perf_counter() - t0)
    for i in range(batch):
        prop.free(f"r{i}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=Path, default=HEADS)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--proposes", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved torch/native rounds")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    backend = CpuBackend.create()
    for kind in ("eagle3", "peagle"):
        prop = Eagle3Proposer(Eagle3Head.from_pretrained(args.heads / kind), kind == "peagle")
        for b in args.batch:
            for k in args.k:
                got = {"torch": [], "native": []}
                for r in range(args.rounds):
                    for mode in ("torch", "native") if r % 2 == 0 else ("native", "torch"):
                        prop.head.use_backend(backend if mode == "native" else None)
                        timed_proposes(prop, b, k, 5)  # warm-up
                        got[mode] += timed_proposes(prop, b, k, args.proposes)
                t, n = (1e3 * statistics.median(got[m]) for m in ("torch", "native"))
                print(
                    f"{kind:7s} batch {b} k={k}: propose torch {t:.2f} ms, native {n:.2f} ms "
                    f"({n / t:.2f}x)"
                )
        if args.profile:
            from torch.profiler import profile

            with profile() as p:
                timed_proposes(prop, args.batch[0], args.k[0], 10)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
