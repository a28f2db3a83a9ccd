"""Our offline ``LLM`` against vLLM's CPU build, side by side on one core.

    flock /tmp/bench.lock taskset -c 0 python bench/vs_vllm.py \\
        --vllm-python /tmp/peers/vllm/bin/python                    # every default workload
    ... --workloads mixed,w64 --rounds 3                            # a subset, more rounds
    ... --workloads b1,w64 --model /tmp/epd-bench-moe/top8          # another checkpoint
    ... --workloads b1,w64 --quantized w8a8                         # its int8 / int4 twin

Each system runs in its own process (``_vs_vllm_worker.py``; vLLM's in the interpreter
given by ``--vllm-python``), loaded once per thread count and pinned with ``taskset`` (the
whole process tree: vLLM's engine core and worker too) to ``--cpus`` (1 thread) or
``--cpus2`` (2 threads). Both get the same checkpoint (``_peers_checkpoint.py``: the
random Llama of docs/serving-peers.md), the same prompt ids (``_vs_vllm_workloads.py``),
greedy sampling with ``ignore_eos``, 1 GiB of KV cache, prefix caching on and reset before
every call. Workloads run one ``generate`` call each, the systems alternating (who goes
first swaps every round); the system not running is SIGSTOPped meanwhile (an idle vLLM's
engine core still polls: 4-11 % of the core while ours ran). Printed per workload: each system's output tok/s (best round,
then every round), the ratio of the bests, the spread of the per-round ratios, and how many
requests' greedy outputs agree. Timings: vLLM compiles for 30-75 s per load; one round of
every default workload takes ~8 min on this machine, mostly ``mixed`` and ``prefix``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _vs_vllm_workloads as workloads  # noqa: E402

# workload: lowest ratio ours / vLLM the issue asks for
GOALS = {"mixed": 1.15, "long": 1.0, "decode": 1.3, "w64": 1.0, "b1": 2.0, "w64_t2": 1.0}
SCALING = ("w64", "w64_t2")  # 2-thread / 1-thread scaling is read off these two


@dataclass
class Result:
    """Every round of one workload on both systems."""

    ours: list[float] = field(default_factory=list)  # output tok/s per round
    vllm: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)  # our engine from --base-root
    agree: tuple[int, int] | None = None  # (requests with equal outputs, requests): vLLM's
    agree_base: tuple[int, int] | None = None  # the same against --base-root's


def ratio_stats(ours: list[float], vllm: list[float]) -> tuple[float, float, float]:
    """(best / best, lowest and highest per-round ratio): the rounds pair by index."""
    per_round = [a / b for a, b in zip(ours, vllm, strict=True)]
    return max(ours) / max(vllm), min(per_round), max(per_round)


def scaling(results: dict[str, Result], system: str) -> float | None:
    """A system's 2-thread / 1-thread throughput on 64 x 128 (best rounds), when both ran."""
    one, two = (results.get(name) for name in SCALING)
    if one is None or two is None or not getattr(one, system) or not getattr(two, system):
        return None
    return max(getattr(two, system)) / max(getattr(one, system))


def thread_groups(names: list[str]) -> dict[int, list[str]]:
    """Workloads by thread count, in the order given (each group is one load per system)."""
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(workloads.build(name).threads, []).append(name)
    return groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", type=Path, help="vLLM's interpreter; without it, ours only")
    ap.add_argument(
        "--workloads",
        default=",".join(workloads.DEFAULT),
        help=f"comma-separated, of: {', '.join(workloads.NAMES)}",
    )
    ap.add_argument(
        "--base-root",
        type=Path,
        help="A/B: also run our engine from this checkout (e.g. /work/main) as "
        "'base'; ours/base ratios are printed",
    )
    ap.add_argument(
        "--ours-config",
        type=json.loads,
        default={},
        help="extra LLM(...) arguments of ours, JSON: '{\"max_num_batched_tokens\": 4096}'",
    )
    ap.add_argument("--base-config", type=json.loads, default={}, help="the same for base")
    ap.add_argument(
        "--vllm-config",
        type=json.loads,
        default={},
        help='vLLM\'s LLM(...) arguments over ours, JSON: \'{"dtype": "bfloat16"}\'',
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds per workload and system")
    ap.add_argument("--rounds2", type=int, default=3, help="rounds of the 2-thread workloads")
    ap.add_argument("--cpus", default="0", help="taskset CPU list at 1 thread")
    ap.add_argument("--cpus2", default="0,1", help="taskset CPU list at 2 threads")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/peers/ckpt"))
    ap.add_argument(
        "--model", type=Path, help="another checkpoint directory (default: the shared Llama)"
    )
    ap.add_argument(
        "--quantized",
        choices=("w8a8", "gptq", "awq"),
        help="serve the checkpoint quantized as published (tests/helpers/"
        "quantized_checkpoints.py): compressed-tensors W8A8 int8, or GPTQ / AWQ int4, "
        "group 128; both systems load the same files",
    )
    ap.add_argument(
        "--log-dir", type=Path, default=Path("/tmp/vs_vllm_logs"), help="each worker's stderr"
    )
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in workloads.NAMES]
    if bad or not args.workloads:
        ap.error(f"unknown workloads {bad}; choose from {', '.join(workloads.NAMES)}")
    if args.rounds < 1 or args.rounds2 < 1:
        ap.error("--rounds and --rounds2 must be >= 1")
    if args.vllm_python is not None and not args.vllm_python.exists():
        ap.error(f"no interpreter at {args.vllm_python}")
    if args.base_root is not None and not (args.base_root / "services").is_dir():
        ap.error(f"no checkout of epd-serve at {args.base_root}")
    return args


class Worker:
    """One system's worker process, pinned with taskset."""

    def __init__(
        self,
        name: str,
        python: Path,
        model: Path,
        threads: int,
        cpus: str,
        log: Path,
        root: Path = HERE.parent,
        config: dict | None = None,
    ) -> None:
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            DO_NOT_TRACK="1",
            VLLM_NO_USAGE_STATS="1",
            OMP_NUM_THREADS=str(threads),
            PYTHONPATH=str(root),
        )
        if name == "vllm":
            env.update(_vllm_env(python, threads, cpus))
        argv = [
            "taskset",
            "-c",
            cpus,
            str(python),
            str(HERE / "_vs_vllm_worker.py"),
            "--system",
            "vllm" if name == "vllm" else "ours",
            "--model",
            str(model),
            "--threads",
            str(threads),
            "--config",
            json.dumps(config or {}),
        ]
        self.name, self.log = name, log
        # Its own session: the CPU time of its whole tree can be read (``cpu_seconds``).
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            text=True,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            start_new_session=True,
        )
        self.config = self._reply()["ready"]

    def run(self, name: str) -> dict:
        """Run one workload; its reply (seconds, tokens, digest)."""
        self.proc.stdin.write(json.dumps({"workload": name}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def _session(self) -> list[tuple[int, list[str]]]:
        """(pid, /proc stat fields after the name) of every process of the worker's session."""
        procs = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            if int(fields[3]) == self.proc.pid:  # field 6 of stat: the session id
                procs.append((int(stat.parent.name), fields))
        return procs

    def cpu_seconds(self) -> float:
        """CPU time used so far by every process of the worker's session."""
        ticks = sum(int(f[11]) + int(f[12]) for _, f in self._session())  # utime + stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def pause(self, stop: bool) -> None:
        """SIGSTOP (or SIGCONT) the whole session: an idle vLLM still polls (its engine core
        took 4-11 % of the core while ours ran), a stopped process takes nothing."""
        for pid, _ in self._session():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _vllm_env(python: Path, threads: int, cpus: str) -> dict[str, str]:
    """vLLM's CPU settings (docs/serving-peers.md): its OpenMP threads bound to ``cpus``."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": _bind(cpus, threads),
        # 0.32.0's AOT compile cache does not load back; its inductor cache does.
        "VLLM_USE_AOT_COMPILE": "0",
    }
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if tcmalloc.exists() and iomp.exists():  # what vLLM asks for; it also runs without
        env["LD_PRELOAD"] = f"{tcmalloc}:{iomp}"
    return env


def _bind(cpus: str, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``threads`` threads on a taskset list like ``0,1``."""
    return cpus if threads > 1 else cpus.replace("-", ",").split(",")[0]


def run_group(
    args, model: Path, threads: int, names: list[str], results: dict[str, Result]
) -> None:
    """Load each system at ``threads`` threads once, then alternate them over the rounds."""
    cpus = args.cpus if threads == 1 else args.cpus2
    rounds = args.rounds if threads == 1 else args.rounds2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    systems = [("ours", Path(sys.executable), HERE.parent, args.ours_config)]
    if args.base_root is not None:
        systems.append(("base", Path(sys.executable), args.base_root, args.base_config))
    if args.vllm_python is not None:
        systems.append(("vllm", args.vllm_python, HERE.parent, args.vllm_config))
    workers = []
    try:
        for name, python, root, config in systems:
            t0 = time.perf_counter()
            log = args.log_dir / f"{name}-t{threads}.log"
            workers.append(Worker(name, python, model, threads, cpus, log, root, config))
            print(
                f"[{threads} thread(s), taskset {cpus}] {name} loaded in "
                f"{time.perf_counter() - t0:.0f} s: {workers[-1].config}",
                flush=True,
            )
        for r in range(rounds):
            order = workers if r % 2 == 0 else workers[::-1]
            for name in names:
                _one_round(name, order, results.setdefault(name, Result()))
    finally:
        for w in workers:
            w.close()


def _one_round(name: str, order: list[Worker], res: Result) -> None:
    """Run workload ``name`` once on each system, in ``order``; record the rates."""
    digests = {}
    for w in order:
        idle = [o for o in order if o is not w]
        before = [o.cpu_seconds() for o in idle]
        for o in idle:
            o.pause(True)
        try:
            reply = w.run(name)
        finally:
            for o in idle:
                o.pause(False)
        rate = reply["tokens"] / reply["seconds"]
        getattr(res, w.name).append(rate)
        digests[w.name] = reply["digest"]
        # The idle system is stopped: its CPU time during the other's run shows it was.
        busy = sum(o.cpu_seconds() for o in idle) - sum(before)
        print(
            f"  {name:<8} {w.name:<5} {rate:8.1f} tok/s ({reply['seconds']:.1f} s; "
            f"the other system used {busy:.1f} CPU s meanwhile)",
            flush=True,
        )
    for other, attr in (("vllm", "agree"), ("base", "agree_base")):
        if other in digests:
            a, b = digests["ours"], digests[other]
            setattr(res, attr, (sum(x == y for x, y in zip(a, b, strict=True)), len(a)))


def _rounds(xs: list[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)


def report(results: dict[str, Result]) -> None:
    """Each workload's rates and ratio, then the goals of issue 14 (met or not)."""
    print(
        "\nworkload                  ours tok/s (rounds)          vLLM tok/s (rounds)"
        "          ratio (per-round spread)  outputs equal"
    )
    for name, res in results.items():
        line = f"{name:<9} {max(res.ours):9.1f} ({_rounds(res.ours)})"
        if res.vllm:
            best, low, high = ratio_stats(res.ours, res.vllm)
            agree = f"{res.agree[0]}/{res.agree[1]}" if res.agree else "-"
            line += (
                f"  {max(res.vllm):9.1f} ({_rounds(res.vllm)})  {best:5.2f}x "
                f"({low:.2f}-{high:.2f})  {agree}"
            )
        if res.base:
            best, low, high = ratio_stats(res.ours, res.base)
            agree = f"{res.agree_base[0]}/{res.agree_base[1]}"
            line += (
                f"\n          base {max(res.base):9.1f} ({_rounds(res.base)}): ours/base "
                f"{best:5.2f}x ({low:.2f}-{high:.2f}), outputs equal {agree}"
            )
        print(f"{line}\n          {workloads.build(name).title}")
    if not any(res.vllm for res in results.values()):
        return
    print("\ngoals (issue 14):")
    for name, target in GOALS.items():
        if name in results and results[name].vllm:
            best = ratio_stats(results[name].ours, results[name].vllm)[0]
            print(f"  {'MET ' if best >= target else 'MISS'} {name}: {best:.2f}x (>= {target}x)")
    ours, theirs = scaling(results, "ours"), scaling(results, "vllm")
    if ours is not None and theirs is not None:
        print(
            f"  {'MET ' if ours >= theirs else 'MISS'} 2-thread / 1-thread on 64 x 128: "
            f"ours {ours:.2f}x, vLLM {theirs:.2f}x (ours >= vLLM's)"
        )


def quantized_twin(src: Path, fmt: str) -> Path:
    """src's weights quantized in a published format, written once beside it."""
    sys.path.insert(0, str(HERE.parent))
    from tests.helpers import quantized_checkpoints as q

    out = src.with_name(f"{src.name}-{fmt}")
    if fmt == "w8a8":
        return q.write_compressed(src, out, 8)[0]
    return (q.write_gptq if fmt == "gptq" else q.write_awq)(src, out, group=128)[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import _peers_checkpoint as ckpt

    model = args.model or ckpt.text_checkpoint(args.cache_dir)
    if args.quantized:
        model = quantized_twin(model, args.quantized)
    print(f"checkpoint {model}; workloads {', '.join(args.workloads)}", flush=True)
    results: dict[str, Result] = {}
    t0 = time.perf_counter()
    for threads, names in sorted(thread_groups(args.workloads).items()):
        run_group(args, model, threads, names, results)
    report(results)
    print(f"took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
