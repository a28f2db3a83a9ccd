"""The ``epd`` command's shared argument groups (engine, service, observability) and the
epilog that lists every setting's environment variable; ``launch.cli`` builds the parser
from them."""

from __future__ import annotations

import argparse


def engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "engine (encoder, prefill, decode, all; the gateway reads the model's tokenizer)"
    )
    g.add_argument(
        "--model",
        action="append",
        default=None,
        help="checkpoint directory or 'demo' (default); gateway and up: repeat it "
        "to serve several models on one fleet (the first is the default)",
    )
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default=None, help="auto (CUDA when present) | cpu | cuda[:N]")
    g.add_argument(
        "--load-format",
        default=None,
        help="auto (safetensors) | dummy (random weights, same architecture)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the checkpoint's)"
    )
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    g.add_argument(
        "--kv-cache-memory-mb",
        type=int,
        default=None,
        help="memory of the KV block pool in MiB (512)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (8192 on CUDA, 2048 on CPU)",
    )
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step (256)")
    g.add_argument("--attention-backend", default=None, help="auto | cpu | torch | triton")
    g.add_argument(
        "--greedy-head-screen",
        default=None,
        help="auto | on | off: greedy tokens through a bfloat16 screen of the LM "
        "head, the same tokens as fp32 (cpu backend; auto: where the CPU has "
        "bfloat16 dot products)",
    )
    g.add_argument(
        "--packed-weights-mb",
        type=int,
        default=None,
        help="memory for oneDNN's packed copies of linear weights, MiB (cpu "
        "backend on non-Intel CPUs; 4096; 0: none)",
    )
    g.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="greedy decode steps per scheduling round (default 1)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, JSON: {"method": "ngram", '
        '"num_speculative_tokens": 3} or {"method": "eagle3", "model": DIR, '
        '"num_speculative_tokens": 3[, "parallel_drafting": true]} '
        "(docs/spec-decode.md)",
    )


def service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service")
    g.add_argument(
        "--nats-url",
        default=None,
        help="NATS server(s), comma-separated (nats://127.0.0.1:4222); may carry "
        "user:password@ or token@ (never logged)",
    )
    g.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the embedding and semantic caches (redis://127.0.0.1:6379/0; "
        "rediss://, redis+sentinel:// and :password@ accepted, never logged)",
    )
    g.add_argument(
        "--instance-id",
        default=None,
        help="unique name of this process on the bus (default <role>-<random>)",
    )
    g.add_argument("--host", default=None, help="address the servers bind (0.0.0.0)")
    g.add_argument("--grpc-port", type=int, default=None, help="gateway gRPC port (50051)")
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="deadline of a whole request, end to end (300)",
    )
    g.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=None,
        help="time in-flight work gets to finish after SIGTERM / Ctrl-C (10)",
    )
    t = p.add_argument_group(
        "credentials and TLS (docs/security.md); user:password or a token "
        "go in --nats-url / --redis-url"
    )
    t.add_argument("--nats-creds", default=None, help="NATS .creds file (user JWT + nkey seed)")
    t.add_argument("--nats-nkey-seed", default=None, help="file holding a NATS user nkey seed")
    t.add_argument("--nats-tls-ca", default=None, help="PEM CA of the NATS server certificate")
    t.add_argument("--nats-tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    t.add_argument("--nats-tls-key", default=None, help="PEM key of --nats-tls-cert")
    a = p.add_argument_group("gateway (gateway, all, up)")
    a.add_argument("--http-port", type=int, default=None, help="OpenAI REST port (default 8000)")
    a.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable)",
    )
    a.add_argument(
        "--allowed-media-domains",
        action="append",
        default=None,
        help="host whose http(s) image URLs may be fetched (repeatable; "
        "'.example.com' admits subdomains)",
    )
    a.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="folder under which file:// image URLs may be read",
    )
    a.add_argument(
        "--router-policy",
        default=None,
        help="least_loaded | power_of_two | round_robin | random | consistent_hash "
        "| prefix_aware (default)",
    )
    a.add_argument(
        "--router-config",
        default=None,
        help="semantic router YAML (model 'auto', PII and jailbreak guards; docs/router.md)",
    )
    a.add_argument(
        "--migration-limit",
        type=int,
        default=None,
        help="times a request may move off a dead worker mid-stream (3)",
    )
    a.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=None,
        help="text prompts with at most this many uncached tokens prefill on "
        "their decode instance (0: off)",
    )
    a.add_argument(
        "--max-inflight-per-instance",
        type=int,
        default=None,
        help="this gateway's requests on one instance before it counts as full",
    )
    c = p.add_argument_group("semantic response cache (cache, gateway, all, up)")
    c.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help="cosine above which a stored question answers a new one (0.80)",
    )
    c.add_argument("--cache-ttl-s", type=int, default=None, help="lifetime of a cached answer")
    c.add_argument("--cache-max-entries", type=int, default=None, help="most answers kept")
    c.add_argument(
        "--no-response-cache",
        dest="cache_enabled",
        action="store_const",
        const=False,
        default=None,
        help="gateway: never ask the semantic cache",
    )


def observability_args(p: argparse.ArgumentParser, metrics: bool = True) -> None:
    g = p.add_argument_group("logs and metrics")
    # SUPPRESS: the same options before the command (epd --log-level ...) are not reset.
    g.add_argument(
        "--log-level", default=argparse.SUPPRESS, help="DEBUG | INFO (default) | WARNING | ERROR"
    )
    g.add_argument(
        "--log-format",
        default=argparse.SUPPRESS,
        choices=("text", "json"),
        help="text (default) or json: one object per line with time, level, service, "
        "instance, request_id, logger, message",
    )
    if metrics:
        g.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve Prometheus /metrics on this port (0: any free port; default "
            "off; the gateway also serves /metrics on its REST port)",
        )


def epilog() -> str:
    from cache_svc.config import SemanticCacheConfig
    from gateway.config import GatewayConfig
    from launch.config_docs import env_help
    from services.config import EngineConfig, ServiceConfig
    from services.observability import ObservabilityConfig

    blocks = [
        ("engine", EngineConfig),
        ("service, bus and credentials", ServiceConfig),
        ("gateway", GatewayConfig),
        ("semantic response cache", SemanticCacheConfig),
        ("logs and metrics", ObservabilityConfig),
    ]
    head = (
        "Every setting is also an environment variable (flags win over variables, "
        "variables over defaults):"
    )
    return "\n\n".join([head, *(env_help(title, cls) for title, cls in blocks)])
