"""Settings of the semantic response cache, for the cache service and the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import FromEnv

# What the question embedding's products may run in (cache_svc/embedder.py).
EMBED_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class SemanticCacheConfig(FromEnv):
    """``EPD_CACHE_*`` variables and CLI flags. Validated at construction."""

    # Gateway: ask the cache at all (per request: the x-epd-cache header).
    cache_enabled: bool = True
    # Cosine of the sentence embeddings above which a stored question may answer a new
    # one (after the second check); bench/semantic_cache.py chose it.
    cache_threshold: float = 0.80
    # Lifetime of a cached answer.
    cache_ttl_s: int = 3600
    # Most answers kept, all tenants together (oldest evicted first).
    cache_max_entries: int = 1_000_000
    # Most answers kept per tenant (API key or `user`); 0: no quota.
    cache_tenant_quota: int = 0
    # Also cache requests that sample (temperature > 0): off, the same question gets
    # the same answer each time instead of a fresh draw.
    cache_sampled: bool = False
    # Gateway: how long a lookup may take. The workers start beside it, so a miss waits
    # only for the part of it that outlasts their first token; a slower lookup is a miss.
    # (Embedding a question takes ~20-25 ms on one core of the development machine, more
    # while the engine computes beside it.)
    cache_lookup_timeout_ms: float = 250.0
    # Gateway: the exact-tier lookup, asked before the workers start, may take this long
    # (one Redis read answers it in a millisecond or two; past it the workers start and
    # the full lookup races them).
    cache_exact_timeout_ms: float = 30.0
    # Gateway: after an exact miss, how long the semantic lookup runs alone before the
    # workers start (0: at once, racing it); a miss decided sooner starts them then. A hit
    # within it never starts them: no prefill slows the lookup down or is thrown away.
    # None ("auto"): the lookup's whole timeout where the cache shares the process of an
    # engine with nothing running (`epd serve all`: the workers' CPU would slow the
    # lookup they race, and nothing streams before it decides); else 0.
    cache_head_start_ms: float | None = None
    # Gateway: how long a store may take (in the background, after the answer is sent).
    cache_store_timeout_ms: float = 1000.0
    # Cache service: a fingerprint's entries are searched exactly up to this many, then
    # through an HNSW graph.
    cache_ann_from: int = 20_000
    # Cache service: the embedding's products in "bfloat16" (oneDNN on AMX tiles or
    # AVX512_BF16: ~30 % faster a question, cosines within 2.5e-3), "float32", or "auto"
    # (bfloat16 where the CPU has either).
    cache_embed_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 < self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in (0, 1], got {self.cache_threshold}")
        for name in (
            "cache_ttl_s",
            "cache_max_entries",
            "cache_lookup_timeout_ms",
            "cache_exact_timeout_ms",
            "cache_store_timeout_ms",
            "cache_ann_from",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cache_embed_dtype not in EMBED_DTYPES:
            raise ValueError(
                f"cache_embed_dtype must be one of {EMBED_DTYPES}, got {self.cache_embed_dtype!r}"
            )
        if self.cache_tenant_quota < 0 or (self.cache_head_start_ms or 0) < 0:
            raise ValueError("cache_tenant_quota and cache_head_start_ms must be >= 0")
