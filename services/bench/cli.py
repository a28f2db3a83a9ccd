"""``epd bench serve``: flags and the run (httpx is imported only when a run starts)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

_NOT_YET = "random-mm, paraphrase: not yet"


def add_bench_parser(sub: Any) -> None:
    """Register ``bench serve`` on the ``epd`` subparsers."""
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load an OpenAI-compatible server; TTFT, TPOT, goodput",
                        description="Stream requests to any OpenAI-compatible base URL and "
                                    "report TTFT, TPOT, ITL, end-to-end latency, throughput, "
                                    "goodput, errors by kind and cache hits by kind.")  # fmt: skip
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server's /v1 URL")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--endpoint", choices=("chat", "completions"), default=None,
                   help="chat (/chat/completions, the default) | completions (/completions, "
                        "the default with --random-token-ids)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", choices=("random", "chat"), default="random",
                   help=f"random (default) | chat (synthetic multi-turn); {_NOT_YET}")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=200, help="requests measured (200)")
    p.add_argument("--random-input-len", type=int, default=256, help="prompt words (256)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens (128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)] (0: fixed)")  # fmt: skip
    p.add_argument("--random-token-ids", action="store_true",
                   help="random prompts as token ids (prompt: [ids] on /completions), so "
                        "servers with different tokenizers get the same prompt tokens")  # fmt: skip
    p.add_argument("--random-token-id-min", type=int, default=1000,
                   help="smallest prompt token id (1000)")  # fmt: skip
    p.add_argument("--random-token-id-max", type=int, default=30000,
                   help="prompt token ids are below this (30000; keep it within the vocab)")  # fmt: skip
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, gamma arrivals (default inf: all at once)")  # fmt: skip
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1.0: Poisson)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (0)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft tpot e2el)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    p.add_argument("--result-json", default=None, help="write the JSON result here")
    p.set_defaults(func=run_bench_serve)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "api_key", "command", "bench_command", "log_level", "log_format"}
    return {k: v for k, v in vars(args).items() if k not in skip}


async def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe; returns the result document."""
    import httpx

    from services.bench.client import build_payload, send_request
    from services.bench.datasets import make_requests
    from services.bench.load import arrival_gaps, run_load
    from services.bench.metrics import parse_goodput, summarize
    from services.bench.report import result_document

    slo = parse_goodput(args.goodput)
    token_ids = None
    if args.random_token_ids:
        if args.endpoint == "chat":
            raise SystemExit("--random-token-ids sends completions prompts: drop --endpoint chat")
        args.endpoint = "completions"
        token_ids = (args.random_token_id_min, args.random_token_id_max)
    args.endpoint = args.endpoint or "chat"
    reqs = make_requests(args.dataset, args.warmup + args.num_prompts, args.random_input_len,
                         args.random_output_len, args.random_range_ratio, args.seed,
                         token_ids=token_ids)  # fmt: skip
    warm, measured = reqs[: args.warmup], reqs[args.warmup :]
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    url = args.base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def send(req: Any) -> Any:
            return await send_request(client, url, build_payload(req, args.model, args.endpoint),
                                      headers)  # fmt: skip

        await run_load(warm, send, [0.0] * len(warm), args.max_concurrency)
        gaps = arrival_gaps(len(measured), args.request_rate, args.burstiness, args.seed)
        start = time.perf_counter()
        records = await run_load(measured, send, gaps, args.max_concurrency)
        duration = time.perf_counter() - start
    return result_document(_config(args), summarize(records, duration, slo), records)


def run_bench_serve(args: argparse.Namespace) -> int:
    """``epd bench serve``: print the table, write the JSON; 1 when every request failed."""
    from services.bench.report import format_table, write_json

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    doc = asyncio.run(bench_serve(args))
    print(format_table(doc["summary"]))
    if args.result_json:
        write_json(args.result_json, doc)
        print(f"result: {args.result_json}")
    return 0 if doc["summary"]["completed"] else 1
