"""One benchmark run, and sweeps of runs over request rates and concurrency caps.

``bench_serve(args)`` is one run's result document; ``bench_sweep(args)`` runs every
(rate, cap) pair of ``--sweep`` x ``--sweep-concurrency`` on the same requests, one after the
other, and returns one document with the list of runs (schema in docs/bench-serve.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from launch.bench.client import RequestRecord, build_payload, send_request, tag
from launch.bench.datasets import BenchRequest, make_requests
from launch.bench.load import gap_stream, run_load
from launch.bench.metrics import parse_goodput, summarize
from launch.bench.report import SCHEMA, json_safe, result_document


@dataclass(frozen=True)
class RunIO:
    """Where a run's time and bytes come from: the real ones, or a test's simulation."""

    transport: httpx.AsyncBaseTransport | None = None  # None: the network
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)


_NOT_CONFIG = {"func", "api_key", "command", "bench_command", "log_level", "log_format"}


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag but the secret ones and argparse's plumbing (header values of
    ``authorization`` are masked)."""
    config = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
    config["header"] = [
        h if h.split(":", 1)[0].strip().lower() != "authorization" else h.split(":", 1)[0] + ":***"
        for h in getattr(args, "header", [])
    ]
    return config


def dataset_requests(args: argparse.Namespace, n: int) -> list[BenchRequest]:
    """``n`` requests of ``args.dataset`` (deterministic for ``args.seed``)."""
    if args.dataset == "random-mm":
        from launch.bench.images import ImageOptions, parse_range, parse_size, random_mm_requests

        opts = ImageOptions(
            per_request=parse_range(args.mm_images_per_request),
            repeat_ratio=args.image_repeat_ratio,
            sizes=tuple(parse_size(s) for s in args.mm_image_size),
            image_format=args.mm_image_format,
        )
        return random_mm_requests(
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            opts,
        )
    if args.dataset == "paraphrase":
        from launch.bench.paraphrase import paraphrase_requests

        return paraphrase_requests(n, args.random_output_len, args.seed, args.paraphrase_mix)
    token_ids = None
    if args.random_token_ids:
        token_ids = (args.random_token_id_min, args.random_token_id_max)
    return make_requests(
        args.dataset,
        n,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
        token_ids=token_ids,
    )


def check_args(args: argparse.Namespace) -> None:
    """Resolve the endpoint and refuse flag combinations that cannot run (SystemExit)."""
    if args.random_token_ids:
        if args.endpoint == "chat" or args.dataset != "random":
            raise SystemExit("--random-token-ids: the random dataset on the completions endpoint")
        args.endpoint = "completions"
    args.endpoint = args.endpoint or "chat"
    if any(":" not in h for h in args.header):
        raise SystemExit(f"--header wants KEY:VALUE, got {args.header}")
    if args.dataset in ("random-mm", "paraphrase") and args.endpoint != "chat":
        raise SystemExit(f"--dataset {args.dataset} sends chat requests: drop --endpoint")
    if args.duration is not None:
        if args.dataset == "paraphrase":
            raise SystemExit("--dataset paraphrase runs by --num-prompts (seeds, then follow-ups)")
        rates = args.sweep or [args.request_rate]
        caps = args.sweep_concurrency or [args.max_concurrency]
        if any(math.isinf(r) for r in rates) and None in caps:
            raise SystemExit("--duration needs a finite --request-rate or a --max-concurrency")


def _phases(reqs: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Paraphrase seeds all answered (and stored) before any follow-up; else one phase."""
    seeds = [r for r in reqs if r.kind == "seed"]
    rest = [r for r in reqs if r.kind != "seed"]
    return [p for p in (seeds, rest) if p] if seeds else [reqs]


def _progress(args: argparse.Namespace, total: int | None, label: str) -> Any:
    """A tqdm bar on stderr (off with --no-progress or when stderr is not a terminal)."""
    from tqdm import tqdm

    off = args.no_progress or not sys.stderr.isatty()
    if total is None:
        label += f", for {args.duration:g} s"
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False, disable=off)


async def measure(
    args: argparse.Namespace,
    send: Callable[[BenchRequest], Any],
    reqs: list[BenchRequest],
    rate: float,
    cap: int | None,
    io: RunIO = RunIO(),
) -> tuple[list[RequestRecord], float]:
    """Warm-up, then the measured requests at ``rate`` under ``cap``; (records, duration)."""
    warm, measured = reqs[: args.warmup], reqs[args.warmup :]
    await run_load(warm, send, [0.0] * len(warm), cap, io.sleep)
    gaps = gap_stream(rate, args.burstiness, args.seed)
    label = f"rate {rate:g}, cap {cap or '-'}"
    with _progress(args, None if args.duration else len(measured), label) as bar:
        records: list[RequestRecord] = []
        start = io.clock()
        for phase in _phases(measured):
            items: Iterable[BenchRequest] = itertools.cycle(phase) if args.duration else phase
            gap_list = gaps if args.duration else list(itertools.islice(gaps, len(phase)))
            records += await run_load(
                items,
                send,
                gap_list,
                cap,
                io.sleep,
                clock=io.clock,
                duration_s=args.duration,
                on_done=lambda _: bar.update(1),
            )
        return records, io.clock() - start


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {k.strip(): v.strip() for k, v in (h.split(":", 1) for h in args.header)}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


async def first_served_model(args: argparse.Namespace, io: RunIO) -> str:
    """The first model of the server's ``/v1/models`` (``vllm bench serve`` does the same
    when ``--model`` is not given)."""
    url = args.base_url.rstrip("/") + "/models"
    async with httpx.AsyncClient(timeout=args.timeout, transport=io.transport) as client:
        try:
            response = await client.get(url, headers=_headers(args))
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as e:
            raise ValueError(f"--model not given and {url} named no model: {e!r}") from e


def _sender(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    user: str | None,
    clock: Callable[[], float],
) -> Callable[[BenchRequest], Any]:
    """Build and send one request's body; the record is tagged with the dataset's facts."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    url = args.base_url.rstrip("/") + path
    headers = _headers(args)

    async def send(req: BenchRequest) -> RequestRecord:
        body = build_payload(req, args.model, args.endpoint)
        if user:
            body["user"] = user
        return tag(await send_request(client, url, body, headers or None, clock), req)

    return send


async def _runs(args: argparse.Namespace, io: RunIO) -> list[dict[str, Any]]:
    """Every (rate, cap) run of the sweep, in order, on the same requests."""
    check_args(args)
    if args.model is None:
        args.model = await first_served_model(args, io)
    slo = parse_goodput(args.goodput)
    reqs = dataset_requests(args, args.warmup + args.num_prompts)
    pairs = list(
        itertools.product(
            args.sweep or [args.request_rate], args.sweep_concurrency or [args.max_concurrency]
        )
    )
    runs = []
    for i, (rate, cap) in enumerate(pairs):
        # A run of its own cache tenant: an earlier run's answers must not turn seeds into hits.
        user = f"{args.user}-{i}" if args.user and len(pairs) > 1 else args.user
        limits = httpx.Limits(max_connections=cap or 1000)
        async with httpx.AsyncClient(
            timeout=args.timeout, limits=limits, transport=io.transport
        ) as client:
            send = _sender(args, client, user, io.clock)
            records, duration = await measure(args, send, reqs, rate, cap, io)
        runs.append(
            {
                "request_rate": rate,
                "max_concurrency": cap,
                "summary": summarize(records, duration, slo),
                "records": records,
            }
        )
    return runs


async def bench_serve(args: argparse.Namespace, io: RunIO = RunIO()) -> dict[str, Any]:
    """One run (the flags' --request-rate and --max-concurrency): its result document."""
    args.sweep, args.sweep_concurrency = [], []
    (run,) = await _runs(args, io)
    return result_document(config_of(args), run["summary"], run["records"])


async def bench_sweep(args: argparse.Namespace, io: RunIO = RunIO()) -> dict[str, Any]:
    """Every run of the sweep: ``{"schema", "config", "runs": [...]}``."""
    runs = await _runs(args, io)
    docs = [result_document({}, r["summary"], r["records"]) for r in runs]
    return json_safe(
        {
            "schema": SCHEMA,
            "config": config_of(args),
            "runs": [
                {
                    "request_rate": r["request_rate"],
                    "max_concurrency": r["max_concurrency"],
                    "summary": d["summary"],
                    "requests": d["requests"],
                }
                for r, d in zip(runs, docs, strict=True)
            ],
        }
    )
