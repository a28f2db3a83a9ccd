"""The ecosystem's benchmark clients, ``guidellm`` and ``aiperf``, against one server.

Each runs from its own venv under the peers dir (docs/serving-peers.md) with the workload of
one ``epd bench serve`` case: prompts of ``isl`` tokens of the shared vocabulary (words
``w<id>``, one token each for every tokenizer of the checkpoint), ``osl`` output tokens
(``ignore_eos``), a concurrency cap and a request count. Their own result files give the
figures, mapped to the names of ``_peers_runs.FIGURES``:

- guidellm: TTFT p50 = ``time_to_first_token_ms`` median; TPOT p50 = its
  ``inter_token_latency_ms`` median (its ``time_per_output_token_ms`` spreads TTFT over
  every token, so it is not our TPOT); output throughput = ``output_tokens_per_second``
  mean over the run;
- aiperf: ``time_to_first_token`` p50, ``inter_token_latency`` p50 (= our TPOT),
  ``request_latency`` p50, ``output_token_throughput``.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    """What every client sends: same lengths, same cap, same count."""

    isl: int
    osl: int
    concurrency: int
    requests: int


def words_prompt(rng: random.Random, n: int) -> str:
    """``n`` words of the shared vocabulary (``w3`` .. ``w31999``): ``n`` tokens."""
    return " ".join(f"w{rng.randrange(1000, 30000)}" for _ in range(n))


def guidellm(
    venv: Path, base_url: str, model: str, ckpt: Path, work: Workload, seed: int, out_dir: Path
) -> tuple[list[str], dict[str, float]]:
    """Run guidellm once; its command line and figures."""
    rng = random.Random(seed)
    prompts = out_dir / f"guidellm-prompts-{seed}.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": words_prompt(rng, work.isl), "output_tokens_count": work.osl})
            + "\n"
            for _ in range(work.requests)
        )
    )
    result = out_dir / f"guidellm-{seed}.json"
    cmd = [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions",
        "--profile",
        f"kind=concurrent,streams={work.concurrency}",
        "--constraint",
        f"kind=max_requests,count={work.requests}",
        "--data",
        f"kind=json_file,path={prompts}",
        "--tokenizer",
        f"kind=huggingface_auto,model={ckpt}",
        "--output",
        f"kind=json,path={result}",
        "--disable-progress",
    ]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    _run(cmd, env, out_dir / f"guidellm-{seed}.log")
    m = json.loads(result.read_text())["benchmarks"][0]["metrics"]

    def ok(key: str) -> dict[str, Any]:
        return m[key]["successful"]

    return cmd, {
        "output_throughput": ok("output_tokens_per_second")["mean"],
        "ttft_p50": ok("time_to_first_token_ms")["median"],
        "tpot_p50": ok("inter_token_latency_ms")["median"],
        "e2el_p50": ok("request_latency")["median"] * 1000.0,
        "goodput": math.nan,
        "failed": m["request_totals"]["errored"],
        "cache": {},
    }


def aiperf(
    venv: Path, base_url: str, model: str, ckpt: Path, work: Workload, seed: int, out_dir: Path
) -> tuple[list[str], dict[str, float]]:
    """Run aiperf once; its command line and figures."""
    art = out_dir / f"aiperf-{seed}"
    cmd = [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model",
        model,
        "--url",
        base_url.removesuffix("/v1"),
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        str(ckpt),
        "--isl",
        str(work.isl),
        "--osl",
        str(work.osl),
        "--concurrency",
        str(work.concurrency),
        "--request-count",
        str(work.requests),
        "--prompt-corpus",
        "random",
        "--random-seed",
        str(seed),
        "--extra-inputs",
        "ignore_eos:true",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--ui",
        "none",
        "--artifact-dir",
        str(art),
    ]
    # Unset on purpose: with HF_HUB_OFFLINE aiperf mistakes a local tokenizer dir for a hub id.
    _run(cmd, {}, out_dir / f"aiperf-{seed}.log", unset=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    d = json.loads((art / "profile_export_aiperf.json").read_text())
    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    return cmd, {
        "output_throughput": d["output_token_throughput"]["avg"],
        "ttft_p50": d["time_to_first_token"]["p50"],
        "tpot_p50": d["inter_token_latency"]["p50"],
        "e2el_p50": d["request_latency"]["p50"],
        "goodput": math.nan,
        "failed": errors,
        "cache": {},
    }


def _run(cmd: list[str], env: dict[str, str], log: Path, unset: tuple[str, ...] = ()) -> None:
    """Run a client to completion, its output in ``log``; raise with the log's end if it failed."""
    import os

    full = {k: v for k, v in os.environ.items() if k not in unset and k != "VIRTUAL_ENV"}
    full.update(env)
    with open(log, "wb") as out:
        rc = subprocess.run(
            cmd,
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),
            timeout=900,
        ).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited {rc}:\n{log.read_text(errors='replace')[-3000:]}")
