"""``epd bench serve``: flags and the entry point (httpx is imported only when a run starts)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any


def add_bench_parser(sub: Any) -> None:
    """Register ``bench serve`` on the ``epd`` subparsers."""
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser(
        "serve",
        help="load an OpenAI-compatible server; TTFT, TPOT, goodput",
        description="Stream requests to any OpenAI-compatible base URL and "
        "report TTFT, TPOT, ITL, end-to-end latency, throughput, "
        "goodput, errors by kind and cache hits by kind.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server's /v1 URL")
    p.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: the first of the server's /v1/models)",
    )
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default=None,
        help="chat (/chat/completions, the default) | completions (/completions, "
        "the default with --random-token-ids)",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--dataset",
        choices=("random", "chat", "random-mm", "paraphrase"),
        default="random",
        help="random (default) | chat (synthetic multi-turn) | random-mm (images) | "
        "paraphrase (semantic-cache seeds, repeats, paraphrases, negatives)",
    )
    p.add_argument("--num-prompts", type=int, default=200, help="requests measured (200)")
    _add_random_flags(p)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, gamma arrivals (default inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1.0: Poisson)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (0)")
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft tpot e2el)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    p.add_argument("--result-json", default=None, help="write the JSON result here")
    _add_dataset_flags(p)
    _add_load_flags(p)
    p.set_defaults(func=run_bench_serve)


def _add_random_flags(p: argparse.ArgumentParser) -> None:
    """The random datasets' lengths and token ids."""
    p.add_argument("--random-input-len", type=int, default=256, help="prompt words (256)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens (128)")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)] (0: fixed)",
    )
    p.add_argument(
        "--random-token-ids",
        action="store_true",
        help="random prompts as token ids (prompt: [ids] on /completions), so "
        "servers with different tokenizers get the same prompt tokens",
    )
    p.add_argument(
        "--random-token-id-min", type=int, default=1000, help="smallest prompt token id (1000)"
    )
    p.add_argument(
        "--random-token-id-max",
        type=int,
        default=30000,
        help="prompt token ids are below this (30000; keep it within the vocab)",
    )


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    """The random-mm and paraphrase datasets' own flags."""
    p.add_argument(
        "--mm-images-per-request",
        default="1",
        metavar="N|MIN..MAX",
        help="random-mm: images per request, uniform in MIN..MAX (1)",
    )
    p.add_argument(
        "--image-repeat-ratio",
        type=float,
        default=0.0,
        help="random-mm: probability an image slot reuses an image already sent (0)",
    )
    p.add_argument(
        "--mm-image-size",
        nargs="+",
        default=["224x224"],
        metavar="WxH",
        help="random-mm: sizes a fresh image is drawn from (224x224)",
    )
    p.add_argument(
        "--mm-image-format",
        choices=("png", "jpeg"),
        default="png",
        help="random-mm: data URL image format (png)",
    )
    p.add_argument(
        "--paraphrase-mix",
        default="repeat:0.3,paraphrase:0.5,negative:0.2",
        help="paraphrase: follow-up kinds and weights (repeat:0.3,paraphrase:0.5,negative:0.2)",
    )


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    """Sweeps, duration, progress, extra request fields, plots."""
    p.add_argument(
        "--sweep",
        type=_rates,
        default=[],
        metavar="R1,R2,...",
        help="one run per request rate, e.g. 1,2,4,inf (one JSON, a list of runs)",
    )
    p.add_argument(
        "--sweep-concurrency",
        type=_caps,
        default=[],
        metavar="C1,C2,...",
        help="one run per --max-concurrency (crossed with --sweep)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="send until S seconds have passed (cycling the dataset), not --num-prompts",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY:VALUE",
        help="extra request header, e.g. x-epd-cache:bypass (repeatable)",
    )
    p.add_argument(
        "--user",
        default=None,
        help="OpenAI 'user' field (epd-serve's cache tenant; a sweep adds -<run>)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="write PNG charts of the run(s) into DIR (needs matplotlib)",
    )


def _rates(spec: str) -> list[float]:
    rates = [float(x) for x in spec.split(",")]
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {spec!r}")
    return rates


def _caps(spec: str) -> list[int]:
    caps = [int(x) for x in spec.split(",")]
    if any(c < 1 for c in caps):
        raise argparse.ArgumentTypeError(f"concurrency caps must be >= 1, got {spec!r}")
    return caps


async def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """One run of the flags; its result document (see ``launch.bench.run``)."""
    from launch.bench.run import bench_serve as run

    return await run(args)


def run_bench_serve(args: argparse.Namespace) -> int:
    """``epd bench serve``: print the table(s), write the JSON and plots; 1 if all failed."""
    from launch.bench.report import format_table, write_json
    from launch.bench.run import bench_sweep

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    sweeping = bool(args.sweep or args.sweep_concurrency)
    doc = asyncio.run(bench_sweep(args) if sweeping else bench_serve(args))
    runs = doc["runs"] if sweeping else [doc]
    for run in runs:
        title = f"rate {run['request_rate']}, cap {run['max_concurrency']}" if sweeping else ""
        print(format_table(run["summary"], title))
    if args.result_json:
        write_json(args.result_json, doc)
        print(f"result: {args.result_json}")
    if args.plot:
        from launch.bench.plot import plot_runs

        for path in plot_runs(doc, args.plot):
            print(f"plot: {path}")
    return 0 if any(run["summary"]["completed"] for run in runs) else 1
