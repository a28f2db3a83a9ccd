"""epd-serve against ``vllm serve`` on JSON-schema-constrained generation (issue 30).

    python bench/structured_vs_vllm.py [--rounds 2] [--systems epd vllm vllm-compact ...]

Goal: epd-serve's output tok/s at concurrency 64 with a JSON schema at least 1.2x vLLM's,
and its valid-output rate at least as high.

Both servers load the shared peers Llama (random weights, ``_peers_checkpoint.py``) with a
byte-level BPE tokenizer (``_peers_bpe.py``), which both systems' grammar backends read.
Every request is the same ``/v1/chat/completions`` call with ``response_format`` of type
``json_schema`` (``structured_outputs.py``'s SCHEMA, bounded so a random model finishes),
greedy, ``max_tokens`` 96, the same prompts. Servers run on core 0 (``taskset``, one torch
thread: ``_peers_servers.py``), this client on core 1. Every system starts once and stays
up; each round runs every case on every system, the order alternating; each system's
best round is reported, with the ratio of epd-serve's to each vLLM's. Valid means the
text parses and fits the schema (``structured_outputs.fits``).

Systems: ``epd`` (``epd up --aggregated``, its default grammar backend), ``epd-xgrammar``
(``--structured-outputs-backend xgrammar``), ``vllm`` as a user starts it (``auto``:
xgrammar for a schema xgrammar supports, else llguidance; the script asks vLLM which),
and vLLM with ``--structured-outputs-config`` set (``VLLM_VARIANTS``). vLLM's default
lets JSON have any whitespace, which a weak model can write until ``max_tokens``
(epd-serve bounds it to one optional space); ``disable_any_whitespace`` (which needs a
named backend) makes its JSON compact.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _peers_servers as servers  # noqa: E402
from _peers_bpe import bpe_checkpoint  # noqa: E402
from serving_peers import start_all  # noqa: E402
from structured_outputs import MAX_TOKENS, SCHEMA, fits  # noqa: E402

log = logging.getLogger("structured_vs_vllm")
CASES = {"c64": (128, 64), "c1": (8, 1)}  # name -> (requests, concurrency)
VLLM_VARIANTS = {  # name -> --structured-outputs-config (None: vLLM's defaults)
    "vllm": None,
    "vllm-compact": {"backend": "xgrammar", "disable_any_whitespace": True},
    "vllm-guidance": {"backend": "guidance"},
    "vllm-guidance-compact": {"backend": "guidance", "disable_any_whitespace": True},
}
SYSTEMS = ("epd", "epd-xgrammar", *VLLM_VARIANTS)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
VLLM_AUTO = """import json, sys
from vllm.sampling_params import SamplingParams, StructuredOutputsParams as SO
from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
try:
    validate_xgrammar_grammar(SamplingParams(structured_outputs=SO(json=json.loads(sys.argv[1]))))
    print("xgrammar")
except Exception as e:
    print(f"guidance (xgrammar refused: {e})")
"""


def prompts(n: int) -> list[str]:
    """The prompts of ``structured_outputs.py``'s offline cases."""
    return [f"record {i}: describe item {i * 7} as json" for i in range(n)]


def make_systems(names: list[str], model: Path, peers: Path) -> list[servers.System]:
    """The servers to compare, one torch thread each; a peer without a venv is left out."""
    found: list[servers.System | None] = []
    for name in names:
        if name.startswith("epd"):
            extra = ["--no-response-cache"]  # repeated prompts must run, not hit a cache
            if name == "epd-xgrammar":
                extra += ["--structured-outputs-backend", "xgrammar"]
            found.append(servers.epd_system(name, model, 1, True, extra))
            continue
        vllm, config = servers.vllm_system(peers / "vllm", model, 1), VLLM_VARIANTS[name]
        if vllm is not None and config is not None:
            argv = [*vllm.argv, "--structured-outputs-config", json.dumps(config)]
            vllm = dataclasses.replace(vllm, name=name, argv=argv)
        found.append(vllm)
    return [s for s in found if s is not None]


def vllm_auto_backend(peers: Path) -> str:
    """What vLLM's ``auto`` picks for SCHEMA: its own rule (xgrammar when
    ``validate_xgrammar_grammar`` accepts the request, else guidance), run in its venv."""
    python = peers / "vllm" / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", VLLM_AUTO, json.dumps(SCHEMA)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"unknown: {done.stderr[-500:]}"


def so_config(running: servers.Running) -> str | None:
    """The ``StructuredOutputsConfig(...)`` vLLM printed at start-up."""
    found = re.search(
        r"structured_outputs_config=(StructuredOutputsConfig\([^)]*\))", running.tail(10**6)
    )
    return found.group(1) if found else None


async def one(client: httpx.AsyncClient, system: servers.System, prompt: str) -> dict[str, Any]:
    """One constrained chat completion: its output tokens, text and finish reason."""
    body = {
        "model": system.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "response_format": RESPONSE_FORMAT,
    }
    resp = await client.post(f"{system.base_url}/chat/completions", json=body)
    if resp.status_code != 200:
        return {"tokens": 0, "text": "", "finish": f"HTTP {resp.status_code}: {resp.text[:200]}"}
    doc = resp.json()
    choice = doc["choices"][0]
    text = choice["message"]["content"] or ""
    return {
        "tokens": doc["usage"]["completion_tokens"],
        "text": text,
        "finish": choice["finish_reason"],
    }


async def load(system: servers.System, texts: list[str], concurrency: int) -> dict[str, Any]:
    """Every prompt of ``texts``, at most ``concurrency`` in flight: tok/s and validity."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def gated(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        async with gate:
            return await one(client, system, prompt)

    async with httpx.AsyncClient(timeout=900.0, limits=limits) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*(gated(client, p) for p in texts))
        secs = time.perf_counter() - start
    tokens = sum(o["tokens"] for o in outs)
    finishes: dict[str, int] = {}
    for o in outs:
        finishes[o["finish"]] = finishes.get(o["finish"], 0) + 1
    return {
        "tok_s": round(tokens / secs, 1),
        "secs": round(secs, 2),
        "output_tokens": tokens,
        "valid": sum(fits(o["text"]) for o in outs),
        "requests": len(outs),
        "finish": finishes,
        "texts": [o["text"] for o in outs],
    }


async def measure(running: list[servers.Running], rounds: int) -> dict[str, dict[str, list]]:
    """case -> system -> one result per round, the systems' order alternating by round."""
    for r in running:  # first constrained requests build tokenizer tables and compile
        await load(r.system, prompts(4), 4)
    runs: dict[str, dict[str, list]] = {case: {} for case in CASES}
    for rnd in range(rounds):
        for ci, (case, (n, conc)) in enumerate(CASES.items()):
            shift = (rnd + ci) % len(running)
            for r in running[shift:] + running[:shift]:
                got = await load(r.system, prompts(n), conc)
                texts = got.pop("texts")
                log.info("round %d %s %s: %s", rnd, case, r.system.name, got)
                runs[case].setdefault(r.system.name, []).append(dict(got, texts=texts))
    return runs


def report(runs: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Per case: each system's best round, epd's ratio to each vLLM, identical outputs."""
    out: dict[str, Any] = {}
    for case, by_system in runs.items():
        best = {n: max(by_system[n], key=lambda r: r["tok_s"]) for n in sorted(by_system)}
        rows = {n: {k: v for k, v in b.items() if k != "texts"} for n, b in best.items()}
        for name, row in rows.items():
            row["valid_rate"] = round(row["valid"] / row["requests"], 3)
            row["rounds_tok_s"] = [r["tok_s"] for r in by_system[name]]
        ours = [n for n in best if n.startswith("epd")]
        theirs = [n for n in best if n.startswith("vllm")]
        ratios = {
            f"{a}/{b}": round(best[a]["tok_s"] / best[b]["tok_s"], 3) for a in ours for b in theirs
        }
        same = {
            f"{a}={b}": sum(x == y for x, y in zip(best[a]["texts"], best[b]["texts"], strict=True))
            for a in ours
            for b in theirs
        }
        out[case] = {"systems": rows, "tok_s_ratio": ratios, "identical_outputs": same}
        print(f"\n== {case} ({CASES[case][0]} requests, concurrency {CASES[case][1]}) ==")
        for name, row in rows.items():
            print(
                f"{name:21s} best {row['tok_s']:6.1f} tok/s ({row['secs']:5.2f} s)  "
                f"rounds {row['rounds_tok_s']}  "
                f"tokens {row['output_tokens']}  valid {row['valid']}/{row['requests']}  "
                f"finish {row['finish']}"
            )
        print("ratios", ratios, "identical outputs", same, flush=True)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["epd", "vllm", "vllm-compact"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peers-dir", type=Path, default=Path("/tmp/peers"), help="peer venvs")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/epd-serve/peers")
    p.add_argument("--logdir", type=Path, default=Path("/tmp/peers/logs/structured"))
    p.add_argument("--result-json", type=Path, default=Path("structured_vs_vllm.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Start the servers, measure, print the table, write ``--result-json``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {1})  # the servers have core 0
    model = bpe_checkpoint(args.cache_dir)
    systems = make_systems(args.systems, model, args.peers_dir)
    doc: dict[str, Any] = {"model": str(model), "schema": SCHEMA, "max_tokens": MAX_TOKENS}
    if any(s.name.startswith("vllm") for s in systems):
        doc["vllm_auto_backend"] = vllm_auto_backend(args.peers_dir)
        log.info("vLLM's auto backend for SCHEMA: %s", doc["vllm_auto_backend"])
    running: list[servers.Running] = []
    try:
        start_all(systems, "0", args.logdir, running)
        doc["vllm_config"] = {
            r.system.name: so_config(r) for r in running if "vllm" in r.system.name
        }
        runs = asyncio.run(measure(running, args.rounds))
    finally:
        for r in running:
            r.stop()
    doc["systems"] = [{"name": s.name, "argv": s.argv} for s in systems]
    doc["results"] = report(runs)
    doc["runs"] = runs
    print("vLLM auto picks:", doc.get("vllm_auto_backend"), "| started with:", doc["vllm_config"])
    args.result_json.write_text(json.dumps(doc, indent=1) + "\n")
    log.info("results in %s", args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
