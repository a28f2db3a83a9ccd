"""The ``epd`` command: generate offline, serve one service, or bring up the whole stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.cli_args import (
    add_model_flag,
    add_setting_flags,
    config_classes,
    config_from_args,
    env_only_epilog,
)

ROLES = ("encoder", "prefill", "decode", "cache", "gateway", "all")


def observability_config(args):
    from services.observability import ObservabilityConfig

    return config_from_args(ObservabilityConfig, args)


def _models(args) -> list[str]:
    """``--model`` as given (repeated only where several models are served)."""
    models = getattr(args, "model", None) or []
    several = getattr(args, "command", None) == "up" or getattr(args, "role", None) == "gateway"
    if len(models) > 1 and not several:
        raise ValueError(
            "one process runs one model: repeat --model only for 'serve gateway' and 'up'"
        )
    return models


def engine_config(args):
    from services.config import EngineConfig

    models = _models(args)
    return config_from_args(EngineConfig, args, model=models[0] if models else None)


def service_config(args):
    from services.config import ServiceConfig

    return config_from_args(ServiceConfig, args)


def gateway_config(args):
    from gateway.config import GatewayConfig

    models = _models(args)
    return config_from_args(GatewayConfig, args, models=tuple(models) if models else None)


def cache_config(args):
    from cache_svc.config import SemanticCacheConfig

    return config_from_args(SemanticCacheConfig, args)


def add_settings(parser: argparse.ArgumentParser, *titles: str, exclude=()) -> None:
    """The flags of the config classes named by ``titles`` (all when none)."""
    add_model_flag(parser)
    for title, cls in config_classes():
        if not titles or title in titles:
            add_setting_flags(parser, title, cls, exclude=exclude)


def _generate(args) -> int:
    from services import LLM, SamplingParams

    cfg = engine_config(args)
    llm = LLM(**vars(cfg))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.request_seed
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
    from services.observability import ObservabilityConfig

    add_setting_flags(parser, "logs", ObservabilityConfig, exclude=("metrics_port",))
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine in this process")
    gen.add_argument("prompt")
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", dest="request_seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    # --seed above is the request's; the engine's own seed stays EPD_SEED.
    add_settings(gen, "engine", "logs and metrics", exclude=("metrics_port", "seed"))
    gen.set_defaults(func=_generate)
    docs = dict(epilog=env_only_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
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
    add_settings(srv)
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
    add_settings(up)
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
