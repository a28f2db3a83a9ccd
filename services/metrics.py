"""Prometheus metrics, named ``epd_*`` (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

IMAGES_ENCODED = Counter("epd_encoder_images_encoded_total", "Images run through the vision tower")
EMBEDDING_CACHE_HITS = Counter("epd_encoder_cache_hits_total", "Encode requests served from Redis")
ENCODE_BATCH = Histogram("epd_encoder_batch_size", "Images per vision-tower batch",
                         buckets=(1, 2, 4, 8, 16, 32, 64))  # fmt: skip
KV_BYTES_SENT = Counter("epd_kv_transfer_bytes_total", "KV bytes sent prefill -> decode")
KV_TRANSFER_SECONDS = Histogram("epd_kv_transfer_seconds", "Time of one KV transfer")
REQUESTS = Counter("epd_gateway_requests_total", "Requests by outcome", ["outcome"])
TTFT = Histogram("epd_gateway_ttft_seconds", "Time to first token at the gateway")
