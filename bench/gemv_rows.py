"""Cost of the native GEMV by rows, on one model's weight shapes (op level, one thread).

    python bench/gemv_rows.py --model DIR [--rows 1 2 4 8 16 32] [--reps 15]
        [--base-lib PATH]

Times ``epd_gemv_t`` over the shapes of every decoder layer's four matrices (qkv, o,
gate_up, down: fresh random W^T of the checkpoint's sizes, so the weights come from memory
as in a decode step) and over its LM head, for R rows, against oneDNN's linear on the
same tensors; prints medians of interleaved repetitions and each one's ratio to one row.
``--base-lib`` also times another build of the kernel library (e.g. main's, from
``~/.cache/epd-serve/kernels``) call by call beside this one: an A/B in one process.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from services.kernels.cpu_backend import CpuBackend
from services.kernels.cpu_native import ptr

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _shapes(model: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(k, n) of each layer matrix as W^T, and of the LM head."""
    c = json.loads((Path(model) / "config.json").read_text())
    hid, inter, d = c["hidden_size"], c["intermediate_size"], c.get("head_dim")
    d = d or hid // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = [(hid, q + 2 * kv), (q, hid), (hid, 2 * inter), (inter, hid)]
    return layer * c["num_hidden_layers"], (hid, c["vocab_size"])


def _timers(libs: dict, layers: list, head, m: int) -> dict:
    """name -> function timing one pass over the stack's matrices or the head at m rows."""
    mats = layers + [head]
    x = torch.randn(m, max(wt.shape[0] for wt in mats))
    y = torch.empty(m, max(wt.shape[1] for wt in mats))
    xs = {k: x[:, :k].contiguous() for k in {wt.shape[0] for wt in mats}}

    def native(lib, mats):
        def run() -> float:
            t0 = time.perf_counter()
            for wt in mats:
                k, n = wt.shape
                lib.epd_gemv_t(ptr(y), n, ptr(xs[k]), ptr(wt), n, None, m, k, n)
            return time.perf_counter() - t0

        return run

    def onednn(mats):
        def run() -> float:
            t0 = time.perf_counter()
            for wt in mats:
                torch.ops.mkldnn._linear_pointwise(xs[wt.shape[0]], wt.t(), None, "none", [], "")
            return time.perf_counter() - t0

        return run

    timers = {}
    for name, lib in libs.items():
        timers[f"{name} layers"], timers[f"{name} head"] = native(lib, layers), native(lib, [head])
    timers["oneDNN layers"], timers["oneDNN head"] = onednn(layers), onednn([head])
    return timers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--base-lib", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {"native": CpuBackend.create().lib}
    if args.base_lib:
        base = ctypes.CDLL(args.base_lib)
        base.epd_gemv_t.restype = None
        base.epd_gemv_t.argtypes = [_P, _I, _P, _P, _I, _P, _I, _I, _I]
        libs["base"] = base
    layer_shapes, head_shape = _shapes(args.model)
    layers = [torch.randn(k, n) for k, n in layer_shapes]
    head = torch.randn(*head_shape)
    print(
        f"{args.model}: {len(layers)} layer matrices + head {head_shape}, 1 thread, "
        f"median of {args.reps}"
    )
    one: dict[str, float] = {}
    with torch.inference_mode():
        for m in args.rows:
            timers = _timers(libs, layers, head, m)
            samples: dict[str, list[float]] = {name: [] for name in timers}
            for _ in range(args.reps):
                for name, fn in timers.items():
                    samples[name].append(fn())
            ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            one = one or ms
            print(
                f"rows {m:3d}: "
                + ", ".join(f"{name} {t:.2f} ms ({t / one[name]:.2f}x)" for name, t in ms.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
