"""The ``epd`` command: generate offline, serve one service, or bring up the whole stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.cli_args import engine_args, epilog, observability_args, service_args

ROLES = ("encoder", "prefill", "decode", "cache", "gateway", "all")


def observability_config(args):
    from services.observability import ObservabilityConfig

    keys = ("log_level", "log_format", "metrics_port")
    return ObservabilityConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def engine_config(args):
    from services.config import EngineConfig

    keys = (
        "dtype",
        "device",
        "load_format",
        "max_model_len",
        "block_size",
        "kv_cache_memory_mb",
        "max_num_batched_tokens",
        "max_num_seqs",
        "attention_backend",
        "num_scheduler_steps",
        "speculative_config",
        "greedy_head_screen",
        "packed_weights_mb",
    )
    models = getattr(args, "model", None) or []
    several = getattr(args, "command", None) == "up" or getattr(args, "role", None) == "gateway"
    if len(models) > 1 and not several:
        raise ValueError(
            "one process runs one model: repeat --model only for 'serve gateway' and 'up'"
        )
    model = models[0] if models else None  # the gateway's default model
    return EngineConfig.from_env(model=model, **{k: getattr(args, k, None) for k in keys})


def service_config(args):
    from services.config import ServiceConfig

    keys = (
        "nats_url",
        "redis_url",
        "instance_id",
        "grpc_port",
        "nats_creds",
        "nats_nkey_seed",
        "nats_tls_ca",
        "nats_tls_cert",
        "nats_tls_key",
        "host",
        "request_timeout_s",
        "shutdown_grace_s",
    )
    return ServiceConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def gateway_config(args):
    from gateway.config import GatewayConfig

    keys = (
        "http_port",
        "api_key",
        "allowed_media_domains",
        "allowed_local_media_path",
        "router_policy",
        "migration_limit",
        "max_inflight_per_instance",
        "max_local_prefill_tokens",
        "router_config",
    )
    models = getattr(args, "model", None)
    return GatewayConfig.from_env(
        models=tuple(models) if models else None, **{k: getattr(args, k, None) for k in keys}
    )


def cache_config(args):
    from cache_svc.config import SemanticCacheConfig

    keys = ("cache_threshold", "cache_ttl_s", "cache_max_entries", "cache_enabled")
    return SemanticCacheConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def _generate(args) -> int:
    from services import LLM, SamplingParams

    cfg = engine_config(args)
    llm = LLM(**vars(cfg))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    images = [Path(p).read_bytes() for p in args.image]
    if args.raw:
        out = llm.generate({"prompt": args.prompt, "images": images}, params)
    else:
        content = [{"type": "image", "image": b} for b in images]
        content.append({"type": "text", "text": args.prompt})
        out = llm.chat([{"role": "user", "content": content}], params)
    comp = out[0].outputs[0]
    print(comp.text)
    print(f"[{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    from launch.serve import serve

    return serve(
        args.role,
        engine_config(args),
        service_config(args),
        gateway_config(args),
        cache_config(args),
        observability_config(args),
    )


def _up(args) -> int:
    from launch.stack import up

    return up(
        args,
        engine_config(args),
        service_config(args),
        gateway_config(args),
        cache_config(args),
        observability_config(args),
    )


def _health(args) -> int:
    """Exit 0 when this container's service is up (Docker health checks): a worker's
    metrics port shows a heartbeat gauge (model loaded, bus joined); the gateway's
    REST ``GET /health`` answers 200 (its workers are seen)."""
    import urllib.error
    import urllib.request

    if args.gateway:
        port = args.port or gateway_config(args).http_port
        url, marker = f"http://{args.host}:{port}/health", None
    else:
        port = args.port or observability_config(args).metrics_port
        if not port:
            print("epd health: no metrics port (set EPD_METRICS_PORT or --port)", file=sys.stderr)
            return 2
        url, marker = f"http://{args.host}:{port}/metrics", "epd_instance_running{"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            body = r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        print(f"epd health: {url}: {e}", file=sys.stderr)
        return 1
    if marker is not None and marker not in body:
        print(f"epd health: {url}: no heartbeat yet", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="epd-serve")
    parser.add_argument("--log-level", default=None, help="DEBUG | INFO (default) | WARNING")
    parser.add_argument(
        "--log-format", default=None, choices=("text", "json"), help="text (default) | json"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine in this process")
    gen.add_argument("prompt")
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    engine_args(gen)
    observability_args(gen, metrics=False)
    gen.set_defaults(func=_generate)
    docs = dict(epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    srv = sub.add_parser(
        "serve",
        help="run one service (or 'all': the aggregated engine)",
        description="Run one service until SIGTERM / Ctrl-C (then drain).",
        **docs,
    )
    srv.add_argument(
        "role",
        choices=ROLES,
        help="encoder | prefill | decode | cache | gateway | all (aggregated "
        "engine behind the gateway)",
    )
    engine_args(srv)
    service_args(srv)
    observability_args(srv)
    srv.set_defaults(func=_serve)
    up = sub.add_parser(
        "up",
        help="start NATS, Redis and every service on this machine",
        description="NATS, Redis and every service as processes on this "
        "machine; Ctrl-C stops them all.",
        **docs,
    )
    up.add_argument("--decode-replicas", type=int, default=1, help="decode processes (1)")
    up.add_argument("--aggregated", action="store_true", help="run 'serve all' instead of E/P/D")
    engine_args(up)
    service_args(up)
    observability_args(up)
    up.set_defaults(func=_up)
    hc = sub.add_parser(
        "health", help="exit 0 when the service in this container is up (Docker health checks)"
    )
    hc.add_argument(
        "--gateway",
        action="store_true",
        help="check the gateway's REST GET /health (EPD_HTTP_PORT) instead of a "
        "worker's metrics port (EPD_METRICS_PORT)",
    )
    hc.add_argument("--host", default="127.0.0.1", help="address to ask (127.0.0.1)")
    hc.add_argument("--port", type=int, default=None, help="port to ask instead")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds (3)")
    hc.set_defaults(func=_health)
    from launch.bench.cli import add_bench_parser  # argparse only; httpx loads on a run

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from services.observability import configure

        configure(
            observability_config(args),
            getattr(args, "role", args.command),
            getattr(args, "instance_id", None) or "",
        )
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"epd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
