"""Cost of one verification forward against one plain decode forward, model only.

    python -m bench.spec_verify_cost --model DIR [--batch 1 8] [--k 3 5 7] [--context 512]
        [--reps 30] [--rows 1 4 8 16]

For each batch size B and k, times (median of interleaved repetitions, one thread) the
target's forward over a step's inputs, without the engine around it:

- ``plain``: B sequences, one new token each (the native one-call step, ``decode_stack``);
- ``native``: B * (1 + k) verify rows through the one-call step (rows as one-token
  queries, ``services/engine/step_meta.py``), whatever the backend's row cap;
- ``layers``: the same rows through the layer-by-layer path (what runs beyond the cap);
- ``extend``: the verification as the extend path ran it before (B sequences of 1 + k
  query rows, the last layer on the kept rows only).

``head``: the greedy verify's head and argmax over those rows through the backend's
``greedy_head`` (the native GEMV + argmax up to its row cap) against torch's
``F.linear`` + ``argmax`` (``torch head``).

``--rows`` also times the bare one-call step on that many one-token sequences against one
(how the GEMV's cost grows with its rows). Contexts are ``--context`` tokens; K/V and
weights are the checkpoint's (values do not change the cost).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.engine.step_meta import attn_meta, out_rows, verify_rows_meta
from services.kernels.cpu_stack import NativeStack
from services.llm import LLM


def _tables(b: int, need: int, num_blocks: int) -> list[list[int]]:
    """B disjoint block tables of ``need`` blocks each."""
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    return [ids[i * need : (i + 1) * need] for i in range(b)]


def _step(b: int, q: int, ctx: int, bs: int, num_blocks: int, mode: str):
    """(positions, meta, keep) of B sequences with q new rows ending at position ctx - 1."""
    tables = _tables(b, -(-ctx // bs), num_blocks)
    pos, slots, row_tables = [], [], []
    for t in tables:
        for p in range(ctx - q, ctx):
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
            row_tables.append(t)
    cpu = torch.device("cpu")
    if mode == "extend":
        meta = attn_meta([q] * b, [ctx] * b, tables, slots, cpu)
        seqs = [i for i in range(b) for _ in range(q)]
        keep = out_rows(list(range(b * q)), seqs, meta, pos, cpu)
    else:
        meta, keep = verify_rows_meta(pos, row_tables, slots, cpu), None
    return torch.tensor(pos), meta, keep


def _timer(llm: LLM, b: int, q: int, ctx: int, mode: str):
    """A function that runs one forward of this shape and returns its seconds."""
    model, kv, backend = llm.engine.model, llm.engine.kv, llm.engine.backend
    pos, meta, keep = _step(b, q, ctx, kv.block_size, kv.num_blocks, mode)
    h = torch.randn(b * q, model.config.hidden_size)
    stack = model.model.native_stack(model.rope)
    native = NativeStack(backend.lib, max_rows=1 << 16)

    def run() -> float:
        t0 = time.perf_counter()
        if mode in ("native", "plain"):
            out = native.run(stack, pos, h, kv.layers, meta)
            assert out is not None
        else:
            saved = backend.decode_stack
            backend.decode_stack = lambda *a: None
            try:
                model(pos, h, kv.layers, meta, keep)
            finally:
                backend.decode_stack = saved
        return time.perf_counter() - t0

    return run


def _head_timers(llm: LLM, rows: int) -> dict:
    """Greedy head of ``rows`` hidden states: the backend's against torch's."""
    model, backend = llm.engine.model, llm.engine.backend
    x = torch.randn(rows, model.config.hidden_size)
    w = model._head()

    def timed(fn):
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    return {
        "head": timed(lambda: backend.greedy_head(x, w)),
        "torch head": timed(lambda: torch.nn.functional.linear(x, w).argmax(-1)),
    }


def _median_ms(timers: dict, reps: int) -> dict[str, float]:
    for fn in timers.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(reps):
        for name, fn in timers.items():
            samples[name].append(fn())
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, device="cpu", num_kv_blocks=1024, attention_backend="cpu")
    print(f"model {args.model}, context {args.context}, 1 thread, median of {args.reps}")
    with torch.inference_mode():
        if args.rows:
            t = _median_ms(
                {r: _timer(llm, r, 1, args.context, "plain") for r in args.rows}, args.reps
            )
            base = t[args.rows[0]]
            print(
                "one-call step of R one-token sequences: "
                + ", ".join(f"R={r} {ms:.3f} ms ({ms / base:.2f}x)" for r, ms in t.items())
            )
        for b in args.batch:
            for k in args.k:
                q = k + 1
                t = _median_ms(
                    {
                        "plain": _timer(llm, b, 1, args.context, "plain"),
                        "native": _timer(llm, b, q, args.context, "native"),
                        "layers": _timer(llm, b, q, args.context, "layers"),
                        "extend": _timer(llm, b, q, args.context, "extend"),
                        **_head_timers(llm, b * q),
                    },
                    args.reps,
                )
                print(
                    f"batch {b} k={k} ({b * q} rows): plain {t['plain']:.3f} ms; verify "
                    + ", ".join(
                        f"{m} {t[m]:.3f} ms ({t[m] / t['plain']:.2f}x)"
                        for m in ("native", "layers", "extend", "head", "torch head")
                    )
                )


if __name__ == "__main__":
    main()
