"""Prometheus metrics, named ``epd_*`` (one registry per process): every metric is
defined here; ``serve_metrics`` exposes them on a port of their own (any role,
``--metrics-port``); the gateway also answers ``/metrics`` on its REST port."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# Latency buckets from 1 ms to 5 min: time to first token, end to end, queueing.
_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# Per-token times: TPOT and inter-token latency.
_TOKEN = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
)

# -- gateway ----------------------------------------------------------------------------
REQUESTS = Counter(
    "epd_gateway_requests_total",
    "Requests by outcome: ok, rejected (at capacity), cancelled (client gone), "
    "or the failure's status (invalid_argument, unavailable, ...)",
    ["outcome"],
)
REQUESTS_IN_PROGRESS = Gauge("epd_gateway_requests_in_progress", "Requests being served")
TTFT = Histogram("epd_gateway_ttft_seconds", "Time to first token at the gateway", buckets=_LATENCY)
TPOT = Histogram(
    "epd_gateway_tpot_seconds",
    "Time per output token after the first, per finished request",
    buckets=_TOKEN,
)
INTER_TOKEN = Histogram(
    "epd_gateway_inter_token_seconds",
    "Gap between two streamed updates of one choice, per token",
    buckets=_TOKEN,
)
E2E = Histogram(
    "epd_gateway_e2e_seconds", "End-to-end time of a finished request", buckets=_LATENCY
)
PROMPT_TOKENS = Counter("epd_gateway_prompt_tokens_total", "Prompt tokens of served requests")
GENERATED_TOKENS = Counter("epd_gateway_generated_tokens_total", "Tokens streamed to clients")
GATEWAY_CACHE = Counter(
    "epd_gateway_cache_requests_total",
    "Requests by semantic-cache outcome at the gateway "
    "(hit_exact, hit_semantic, miss, skipped, unavailable)",
    ["outcome"],
)
MIGRATIONS = Counter(
    "epd_gateway_request_moves_total",
    "Requests moved off a failed worker: retries (nothing sent yet) and "
    "migrations (mid-stream), by the failed worker's role",
    ["role", "kind"],
)
DROPPED_UPDATES = Counter(
    "epd_gateway_dropped_updates_total",
    "Token updates from an instance that does not hold the request",
)

# -- engine (prefill, decode, all) ------------------------------------------------------
QUEUE_TIME = Histogram(
    "epd_engine_queue_seconds",
    "Time from a request's arrival at the engine to its first scheduled step",
    buckets=_LATENCY,
)
PREFILL_TIME = Histogram(
    "epd_engine_prefill_seconds",
    "Time from a request's first scheduled step to its first sampled token",
    buckets=_LATENCY,
)
BATCH_SIZE = Histogram(
    "epd_engine_batch_size",
    "Requests in one engine step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
ENGINE_PROMPT_TOKENS = Counter(
    "epd_engine_prompt_tokens_total", "Prompt tokens of requests admitted to the engine"
)
ENGINE_CACHED_TOKENS = Counter(
    "epd_engine_prefix_cache_hit_tokens_total",
    "Prompt tokens found in the prefix cache at admission "
    "(hit rate = this / epd_engine_prompt_tokens_total)",
)
ENGINE_GENERATED_TOKENS = Counter("epd_engine_generated_tokens_total", "Tokens sampled")
PREEMPTIONS = Counter("epd_engine_preemptions_total", "Requests preempted (recomputed later)")
# Speculative decoding (services/engine/spec/metrics.py). Mean acceptance length =
# (accepted + verifications) / verifications; acceptance at draft position i =
# accepted_by_position{i} / drafts_by_position{i}.
SPEC_VERIFICATIONS = Counter(
    "epd_spec_verifications_total", "Request-steps that verified one or more draft tokens"
)
SPEC_DRAFT_TOKENS = Counter("epd_spec_draft_tokens_total", "Draft tokens verified")
SPEC_ACCEPTED_TOKENS = Counter("epd_spec_accepted_tokens_total", "Draft tokens accepted")
SPEC_DRAFTS_BY_POSITION = Counter(
    "epd_spec_drafts_by_position_total",
    "Draft tokens verified, by position in the draft (0: first)",
    ["position"],
)
SPEC_ACCEPTED_BY_POSITION = Counter(
    "epd_spec_accepted_by_position_total",
    "Draft tokens accepted, by position in the draft (0: first)",
    ["position"],
)
# Updated with every heartbeat from the instance's load (one instance per process, bar tests).
RUNNING = Gauge("epd_instance_running", "Requests running", ["role", "instance"])
WAITING = Gauge("epd_instance_waiting", "Requests waiting", ["role", "instance"])
KV_BLOCKS_FREE = Gauge("epd_instance_kv_blocks_free", "Free KV blocks", ["role", "instance"])
KV_BLOCKS_USED = Gauge("epd_instance_kv_blocks_used", "KV blocks in use", ["role", "instance"])
KV_BYTES_SENT = Counter("epd_kv_transfer_bytes_total", "KV bytes sent prefill -> decode")
KV_TRANSFER_SECONDS = Histogram("epd_kv_transfer_seconds", "Time of one KV transfer")

# -- encoder ----------------------------------------------------------------------------
IMAGES_ENCODED = Counter("epd_encoder_images_encoded_total", "Images run through the vision tower")
ENCODE_BATCH = Histogram(
    "epd_encoder_batch_size", "Images per vision-tower batch", buckets=(1, 2, 4, 8, 16, 32, 64)
)
ENCODE_SECONDS = Histogram(
    "epd_encoder_encode_seconds",
    "Time of one vision-tower batch (preprocess + forward)",
    buckets=_LATENCY,
)
EMBEDDING_CACHE_HITS = Counter("epd_encoder_cache_hits_total", "Encode requests served from Redis")
EMBEDDING_CACHE_MISSES = Counter(
    "epd_encoder_cache_misses_total", "Encode requests the embedding cache could not serve"
)
EMBEDDING_CACHE_BYTES = Counter(
    "epd_encoder_cache_bytes_written_total", "Bytes of embeddings written to the embedding cache"
)
EMBEDDING_SINGLEFLIGHT_JOINS = Counter(
    "epd_encoder_singleflight_joins_total", "Encode requests that waited for the same image's pass"
)

# -- semantic cache (cache service) -----------------------------------------------------
SEMANTIC_CACHE_LOOKUPS = Counter(
    "epd_semantic_cache_lookups_total", "Semantic cache lookups by result", ["result"]
)
SEMANTIC_CACHE_GUARD = Counter(
    "epd_semantic_cache_guard_rejections_total",
    "Candidates above the threshold that the second check refused",
    ["reason"],
)
SEMANTIC_CACHE_LOOKUP_SECONDS = Histogram(
    "epd_semantic_cache_lookup_seconds",
    "Time of one semantic cache lookup (cache service)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
SEMANTIC_CACHE_ENTRIES = Gauge("epd_semantic_cache_entries", "Entries in this replica's index")
SEMANTIC_CACHE_STORES = Counter(
    "epd_semantic_cache_stores_total", "Answers stored, by result", ["result"]
)

# -- semantic router (gateway) ---------------------------------------------------------
ROUTER_DECISIONS = Counter(
    "epd_router_decisions_total",
    "Requests the semantic router sent to a route, by route and model",
    ["route", "model"],
)
ROUTER_GUARD = Counter(
    "epd_router_guard_total",
    "Guard outcomes that found something, by guard (pii, jailbreak) and "
    "action (allow: found and let through, redact, block)",
    ["guard", "action"],
)
ROUTER_SECONDS = Histogram(
    "epd_router_decision_seconds",
    "Time of one router decision, the embedding wait included",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
ROUTER_EMBEDDINGS = Counter(
    "epd_router_embeddings_total",
    "Request embeddings the router asked for, by result (ok, unavailable)",
    ["result"],
)
ROUTER_RELOADS = Counter(
    "epd_router_config_reloads_total",
    "Router config reloads by result (ok, refused: the old config stays)",
    ["result"],
)

# -- bus --------------------------------------------------------------------------------
BUS_REQUEST_SECONDS = Histogram(
    "epd_bus_request_seconds",
    "Round trip of one bus request, by the subject's first two "
    "tokens (epd.prefill, epd.encoder, ...)",
    ["subject"],
    buckets=_LATENCY,
)


def subject_kind(subject: str) -> str:
    """The label of ``subject``: its first two tokens (instance ids stay out of labels)."""
    return ".".join(subject.split(".", 2)[:2])


def serve_metrics(port: int, host: str = "0.0.0.0") -> WSGIServer:
    """Serve /metrics on ``port`` (0: any free port; the server's ``server_port`` says)
    in a daemon thread; ``stop_metrics`` closes it."""
    server, _thread = start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server


def stop_metrics(server: WSGIServer) -> None:
    server.shutdown()
    server.server_close()
