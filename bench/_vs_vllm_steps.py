"""Step timers shared by ``_vs_vllm_profile.py`` (ours) and ``_vs_vllm_vprofile.py``
(vLLM's): standard library only, so vLLM's interpreter imports it too."""

from __future__ import annotations

import time
from collections import defaultdict

TIMES: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, seconds]
STEPS: list[list[float]] = []  # per step: [prefill tokens, decode rows, seconds]


def timed(obj, attr: str, name: str, split=None) -> None:
    """Replace ``obj.attr`` by a wrapper adding its wall time to ``TIMES[name]`` (or to
    the name ``split(*args)`` returns)."""
    fn = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = TIMES[split(*args) if split else name]
            rec[0] += 1
            rec[1] += time.perf_counter() - t0

    setattr(obj, attr, wrapper)


def step_kind(prefill_tokens: float, decode_rows: float) -> str:
    """``prefill``, ``mixed`` (prefill chunks and decode rows) or ``decode``."""
    if prefill_tokens and decode_rows:
        return "mixed"
    return "prefill" if prefill_tokens else "decode"


def report(seconds: float, tokens: int) -> None:
    """Print the steps by kind, then every timer, as shares of ``seconds``."""
    steps = [s for s in STEPS if s[0] or s[1]]
    print(
        f"run: {seconds:.1f} s, {tokens} output tokens, {tokens / seconds:.1f} tok/s, "
        f"{len(steps)} steps"
    )
    print("\nsteps by kind      steps   seconds  share  prefill tok  decode rows  ms/step")
    for kind in ("prefill", "mixed", "decode"):
        rows = [s for s in steps if step_kind(s[0], s[1]) == kind]
        if rows:
            t = sum(r[2] for r in rows)
            print(
                f"  {kind:<14} {len(rows):7d} {t:9.2f} {100 * t / seconds:5.1f}% "
                f"{sum(r[0] for r in rows):12.0f} {sum(r[1] for r in rows):12.0f} "
                f"{1000 * t / len(rows):8.2f}"
            )
    print("\ntimer                                      calls   seconds  share")
    for name, (calls, t) in sorted(TIMES.items()):
        print(f"  {name:<40} {calls:7d} {t:9.2f} {100 * t / seconds:5.1f}%")
