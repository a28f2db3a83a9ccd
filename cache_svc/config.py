"""Settings of the semantic response cache, for the cache service and the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from services.settings import Settings, setting

# What the question embedding's products may run in (cache_svc/embedder.py).
EMBED_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class SemanticCacheConfig(Settings):
    """The semantic response cache's settings. Validated at construction."""

    cache_enabled: bool = setting(
        True,
        doc="Gateway: ask the cache at all (per request: the `x-epd-cache` header).",
        flags=("--no-response-cache",),
    )
    cache_threshold: float = setting(
        0.80,
        doc="Cosine of the sentence embeddings above which a stored question may answer a "
        "new one (after the second check); bench/semantic_cache.py chose it.",
        gt=0.0,
        le=1.0,
    )
    cache_ttl_s: int = setting(3600, doc="Lifetime of a cached answer, seconds.", gt=0)
    cache_max_entries: int = setting(
        1_000_000, doc="Most answers kept, all tenants together (oldest evicted first).", gt=0
    )
    cache_tenant_quota: int = setting(
        0, doc="Most answers kept per tenant (API key or `user`); 0: no quota.", ge=0
    )
    cache_sampled: bool = setting(
        False,
        doc="Also cache requests that sample (temperature > 0): off, the same question gets "
        "the same answer each time instead of a fresh draw.",
    )
    cache_lookup_timeout_ms: float = setting(
        250.0,
        doc="Gateway: how long a lookup may take, ms. The workers start beside it, so a miss "
        "waits only for the part of it that outlasts their first token; a slower lookup is "
        "a miss.",
        gt=0,
    )
    cache_exact_timeout_ms: float = setting(
        30.0,
        doc="Gateway: how long the exact-tier lookup, asked before the workers start, may "
        "take, ms (one Redis read answers it in a millisecond or two; past it the workers "
        "start and the full lookup races them).",
        gt=0,
    )
    cache_head_start_ms: float | None = setting(
        None,
        doc="Gateway: after an exact miss, how long the semantic lookup runs alone before "
        "the workers start, ms (0: at once, racing it); a hit within it never starts them. "
        "Unset (`auto`): the lookup's whole timeout where the cache shares the process of "
        "an engine with nothing running (`epd serve all`), else 0.",
        ge=0,
    )
    cache_store_timeout_ms: float = setting(
        1000.0,
        doc="Gateway: how long a store may take, ms (in the background, after the answer is sent).",
        gt=0,
    )
    cache_ann_from: int = setting(
        20_000,
        doc="Cache service: a fingerprint's entries are searched exactly up to this many, "
        "then through an HNSW graph.",
        gt=0,
    )
    cache_embed_dtype: str = setting(
        "auto",
        doc="Cache service: the question embedding's products in `bfloat16` (oneDNN on AMX "
        "tiles or AVX512_BF16: ~30 % faster, cosines within 2.5e-3), `float32`, or `auto` "
        "(bfloat16 where the CPU has either).",
        choices=EMBED_DTYPES,
    )
