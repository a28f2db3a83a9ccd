"""The ``epd`` command: generate offline, serve one service, or bring up the whole stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROLES = ("encoder", "prefill", "decode", "cache", "gateway", "all")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (encoder, prefill, decode, all; the gateway reads the "
                             "model's tokenizer)")  # fmt: skip
    g.add_argument("--model", action="append", default=None,
                   help="checkpoint directory or 'demo' (default); gateway and up: repeat it "
                        "to serve several models on one fleet (the first is the default)")  # fmt: skip
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default=None, help="auto (CUDA when present) | cpu | cuda[:N]")
    g.add_argument("--load-format", default=None,
                   help="auto (safetensors) | dummy (random weights, same architecture)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the checkpoint's)")  # fmt: skip
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    g.add_argument("--kv-cache-memory-mb", type=int, default=None,
                   help="memory of the KV block pool in MiB (512)")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (8192 on CUDA, 2048 on CPU)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step (256)")
    g.add_argument("--attention-backend", default=None, help="auto | cpu | torch | triton")
    g.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="greedy decode steps per scheduling round (default 1)")  # fmt: skip
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 3} or {"method": "eagle3", "model": DIR, '
                        '"num_speculative_tokens": 3[, "parallel_drafting": true]} '
                        "(docs/spec-decode.md)")  # fmt: skip


def _service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--nats-url", default=None,
                   help="NATS server(s), comma-separated (nats://127.0.0.1:4222); may carry "
                        "user:password@ or token@ (never logged)")  # fmt: skip
    g.add_argument("--redis-url", default=None,
                   help="Redis for the embedding and semantic caches (redis://127.0.0.1:6379/0; "
                        "rediss://, redis+sentinel:// and :password@ accepted, never logged)")  # fmt: skip
    g.add_argument("--instance-id", default=None,
                   help="unique name of this process on the bus (default <role>-<random>)")  # fmt: skip
    g.add_argument("--host", default=None, help="address the servers bind (0.0.0.0)")
    g.add_argument("--grpc-port", type=int, default=None, help="gateway gRPC port (50051)")
    g.add_argument("--request-timeout-s", type=float, default=None,
                   help="deadline of a whole request, end to end (300)")  # fmt: skip
    g.add_argument("--shutdown-grace-s", type=float, default=None,
                   help="time in-flight work gets to finish after SIGTERM / Ctrl-C (10)")  # fmt: skip
    t = p.add_argument_group("credentials and TLS (docs/security.md); user:password or a token "
                             "go in --nats-url / --redis-url")  # fmt: skip
    t.add_argument("--nats-creds", default=None, help="NATS .creds file (user JWT + nkey seed)")
    t.add_argument("--nats-nkey-seed", default=None, help="file holding a NATS user nkey seed")
    t.add_argument("--nats-tls-ca", default=None, help="PEM CA of the NATS server certificate")
    t.add_argument("--nats-tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    t.add_argument("--nats-tls-key", default=None, help="PEM key of --nats-tls-cert")
    a = p.add_argument_group("gateway (gateway, all, up)")
    a.add_argument("--http-port", type=int, default=None, help="OpenAI REST port (default 8000)")
    a.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable)")  # fmt: skip
    a.add_argument("--allowed-media-domains", action="append", default=None,
                   help="host whose http(s) image URLs may be fetched (repeatable; "
                        "'.example.com' admits subdomains)")  # fmt: skip
    a.add_argument("--allowed-local-media-path", default=None,
                   help="folder under which file:// image URLs may be read")  # fmt: skip
    a.add_argument("--router-policy", default=None,
                   help="least_loaded | power_of_two | round_robin | random | consistent_hash "
                        "| prefix_aware (default)")  # fmt: skip
    a.add_argument("--router-config", default=None,
                   help="semantic router YAML (model 'auto', PII and jailbreak guards; "
                        "docs/router.md)")  # fmt: skip
    a.add_argument("--migration-limit", type=int, default=None,
                   help="times a request may move off a dead worker mid-stream (3)")  # fmt: skip
    a.add_argument("--max-local-prefill-tokens", type=int, default=None,
                   help="text prompts with at most this many uncached tokens prefill on "
                        "their decode instance (0: off)")  # fmt: skip
    a.add_argument("--max-inflight-per-instance", type=int, default=None,
                   help="this gateway's requests on one instance before it counts as full")  # fmt: skip
    c = p.add_argument_group("semantic response cache (cache, gateway, all, up)")
    c.add_argument("--cache-threshold", type=float, default=None,
                   help="cosine above which a stored question answers a new one (0.80)")  # fmt: skip
    c.add_argument("--cache-ttl-s", type=int, default=None, help="lifetime of a cached answer")
    c.add_argument("--cache-max-entries", type=int, default=None, help="most answers kept")
    c.add_argument("--no-response-cache", dest="cache_enabled", action="store_const", const=False,
                   default=None, help="gateway: never ask the semantic cache")  # fmt: skip


def _observability_args(p: argparse.ArgumentParser, metrics: bool = True) -> None:
    g = p.add_argument_group("logs and metrics")
    # SUPPRESS: the same options before the command (epd --log-level ...) are not reset.
    g.add_argument("--log-level", default=argparse.SUPPRESS,
                   help="DEBUG | INFO (default) | WARNING | ERROR")  # fmt: skip
    g.add_argument("--log-format", default=argparse.SUPPRESS, choices=("text", "json"),
                   help="text (default) or json: one object per line with time, level, service, "
                        "instance, request_id, logger, message")  # fmt: skip
    if metrics:
        g.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics on this port (0: any free port; default "
                            "off; the gateway also serves /metrics on its REST port)")  # fmt: skip


def _epilog() -> str:
    from cache_svc.config import SemanticCacheConfig
    from gateway.config import GatewayConfig
    from services.config import EngineConfig, ServiceConfig
    from services.config_docs import env_help
    from services.observability import ObservabilityConfig

    blocks = [("engine", EngineConfig), ("service, bus and credentials", ServiceConfig),
              ("gateway", GatewayConfig), ("semantic response cache", SemanticCacheConfig),
              ("logs and metrics", ObservabilityConfig)]  # fmt: skip
    head = ("Every setting is also an environment variable (flags win over variables, "
            "variables over defaults):")  # fmt: skip
    return "\n\n".join([head, *(env_help(title, cls) for title, cls in blocks)])


def observability_config(args):
    from services.observability import ObservabilityConfig

    keys = ("log_level", "log_format", "metrics_port")
    return ObservabilityConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def engine_config(args):
    from services.config import EngineConfig

    keys = ("dtype", "device", "load_format", "max_model_len", "block_size",
            "kv_cache_memory_mb", "max_num_batched_tokens", "max_num_seqs", "attention_backend",
            "num_scheduler_steps", "speculative_config")  # fmt: skip
    models = getattr(args, "model", None) or []
    several = getattr(args, "command", None) == "up" or getattr(args, "role", None) == "gateway"
    if len(models) > 1 and not several:
        raise ValueError("one process runs one model: repeat --model only for 'serve gateway' "
                         "and 'up'")  # fmt: skip
    model = models[0] if models else None  # the gateway's default model
    return EngineConfig.from_env(model=model, **{k: getattr(args, k, None) for k in keys})


def service_config(args):
    from services.config import ServiceConfig

    keys = ("nats_url", "redis_url", "instance_id", "grpc_port", "nats_creds", "nats_nkey_seed",
            "nats_tls_ca", "nats_tls_cert", "nats_tls_key", "host", "request_timeout_s",
            "shutdown_grace_s")  # fmt: skip
    return ServiceConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def gateway_config(args):
    from gateway.config import GatewayConfig

    keys = ("http_port", "api_key", "allowed_media_domains", "allowed_local_media_path",
            "router_policy", "migration_limit", "max_inflight_per_instance",
            "max_local_prefill_tokens", "router_config")  # fmt: skip
    models = getattr(args, "model", None)
    return GatewayConfig.from_env(models=tuple(models) if models else None,
                                  **{k: getattr(args, k, None) for k in keys})  # fmt: skip


def cache_config(args):
    from cache_svc.config import SemanticCacheConfig

    keys = ("cache_threshold", "cache_ttl_s", "cache_max_entries", "cache_enabled")
    return SemanticCacheConfig.from_env(**{k: getattr(args, k, None) for k in keys})


def _generate(args) -> int:
    from services import LLM, SamplingParams

    cfg = engine_config(args)
    llm = LLM(**vars(cfg))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)  # fmt: skip
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
    from services.serve import serve

    return serve(
        args.role,
        engine_config(args),
        service_config(args),
        gateway_config(args),
        cache_config(args),
        observability_config(args),
    )


def _up(args) -> int:
    from services.stack import up

    return up(args, engine_config(args), service_config(args), gateway_config(args),
              cache_config(args), observability_config(args))  # fmt: skip


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
    parser.add_argument("--log-format", default=None, choices=("text", "json"),
                        help="text (default) | json")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine in this process")
    gen.add_argument("prompt")
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    _engine_args(gen)
    _observability_args(gen, metrics=False)
    gen.set_defaults(func=_generate)
    docs = dict(epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    srv = sub.add_parser("serve", help="run one service (or 'all': the aggregated engine)",
                         description="Run one service until SIGTERM / Ctrl-C (then drain).",
                         **docs)  # fmt: skip
    srv.add_argument("role", choices=ROLES,
                     help="encoder | prefill | decode | cache | gateway | all (aggregated "
                          "engine behind the gateway)")  # fmt: skip
    _engine_args(srv)
    _service_args(srv)
    _observability_args(srv)
    srv.set_defaults(func=_serve)
    up = sub.add_parser("up", help="start NATS, Redis and every service on this machine",
                        description="NATS, Redis and every service as processes on this "
                                    "machine; Ctrl-C stops them all.", **docs)  # fmt: skip
    up.add_argument("--decode-replicas", type=int, default=1, help="decode processes (1)")
    up.add_argument("--aggregated", action="store_true", help="run 'serve all' instead of E/P/D")
    _engine_args(up)
    _service_args(up)
    _observability_args(up)
    up.set_defaults(func=_up)
    hc = sub.add_parser("health", help="exit 0 when the service in this container is up "
                        "(Docker health checks)")  # fmt: skip
    hc.add_argument("--gateway", action="store_true",
                    help="check the gateway's REST GET /health (EPD_HTTP_PORT) instead of a "
                         "worker's metrics port (EPD_METRICS_PORT)")  # fmt: skip
    hc.add_argument("--host", default="127.0.0.1", help="address to ask (127.0.0.1)")
    hc.add_argument("--port", type=int, default=None, help="port to ask instead")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds (3)")
    hc.set_defaults(func=_health)
    from services.bench.cli import add_bench_parser  # argparse only; httpx loads on a run

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from services.observability import configure

        configure(observability_config(args), getattr(args, "role", args.command),
                  getattr(args, "instance_id", None) or "")  # fmt: skip
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"epd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
