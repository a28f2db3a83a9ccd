"""Prometheus metrics, named ``epd_*`` (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

IMAGES_ENCODED = Counter("epd_encoder_images_encoded_total", "Images run through the vision tower")
EMBEDDING_CACHE_HITS = Counter("epd_encoder_cache_hits_total", "Encode requests served from Redis")
ENCODE_BATCH = Histogram("epd_encoder_batch_size", "Images per vision-tower batch",
                         buckets=(1, 2, 4, 8, 16, 32, 64))  # fmt: skip
KV_BYTES_SENT = Counter("epd_kv_transfer_bytes_total", "KV bytes sent prefill -> decode")
KV_TRANSFER_SECONDS = Histogram("epd_kv_transfer_seconds", "Time of one KV transfer")
REQUESTS = Counter("epd_gateway_requests_total", "Requests by outcome", ["outcome"])
TTFT = Histogram("epd_gateway_ttft_seconds", "Time to first token at the gateway")
EMBEDDING_CACHE_MISSES = Counter("epd_encoder_cache_misses_total",
                                 "Encode requests the embedding cache could not serve")  # fmt: skip
EMBEDDING_CACHE_BYTES = Counter("epd_encoder_cache_bytes_written_total",
                                "Bytes of embeddings written to the embedding cache")  # fmt: skip
EMBEDDING_SINGLEFLIGHT_JOINS = Counter("epd_encoder_singleflight_joins_total",
                                       "Encode requests that waited for the same image's pass")  # fmt: skip
SEMANTIC_CACHE_LOOKUPS = Counter("epd_semantic_cache_lookups_total",
                                 "Semantic cache lookups by result", ["result"])  # fmt: skip
SEMANTIC_CACHE_GUARD = Counter("epd_semantic_cache_guard_rejections_total",
                               "Candidates above the threshold that the second check refused",
                               ["reason"])  # fmt: skip
SEMANTIC_CACHE_LOOKUP_SECONDS = Histogram(
    "epd_semantic_cache_lookup_seconds",
    "Time of one semantic cache lookup (cache service)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
SEMANTIC_CACHE_ENTRIES = Gauge("epd_semantic_cache_entries", "Entries in this replica's index")
SEMANTIC_CACHE_STORES = Counter("epd_semantic_cache_stores_total", "Answers stored, by result",
                                ["result"])  # fmt: skip
GATEWAY_CACHE = Counter("epd_gateway_cache_requests_total",
                        "Requests by semantic-cache outcome at the gateway "
                        "(hit_exact, hit_semantic, miss, skipped, unavailable)", ["outcome"])  # fmt: skip
MIGRATIONS = Counter("epd_gateway_request_moves_total",
                     "Requests moved off a failed worker: retries (nothing sent yet) and "
                     "migrations (mid-stream), by the failed worker's role",
                     ["role", "kind"])  # fmt: skip
DROPPED_UPDATES = Counter(
    "epd_gateway_dropped_updates_total",
    "Token updates from an instance that does not hold the request",
)
