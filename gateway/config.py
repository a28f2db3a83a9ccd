"""What the gateway's front doors accept: ports, API keys, request and media limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policies import POLICIES
from services.config import FromEnv
from services.image_checks import MAX_IMAGE_PIXELS


@dataclass
class GatewayConfig(FromEnv):
    """The gateway's own settings (``EPD_*`` variables, CLI flags). Validated at construction."""

    # The models this gateway serves over the fleet (EPD_MODELS, comma-separated; or
    # --model repeated), the first being the default of requests that name none. Empty:
    # the engine's one model (EPD_MODEL / --model).
    models: tuple[str, ...] = ()
    # OpenAI-compatible REST port (0: any free port).
    http_port: int = 8000
    # Bearer tokens accepted on /v1/* (EPD_API_KEY: comma-separated). Empty: no auth.
    # Secrets: kept out of repr, so out of logs.
    api_key: tuple[str, ...] = field(default=(), repr=False)
    # Most choices per request (``n``).
    max_n: int = 16
    # Most stop strings per request, and the longest one, in characters.
    max_stop: int = 16
    max_stop_chars: int = 256
    # Most stop_token_ids per request.
    max_stop_token_ids: int = 256
    # Per request: most images, largest encoded image, most pixels in one image.
    max_images: int = 16
    max_image_bytes: int = 64 << 20
    max_image_pixels: int = MAX_IMAGE_PIXELS
    # Largest REST request body (a 20 MB image is ~27 MB as a base64 data URL).
    max_body_mb: int = 128
    # Hosts whose http(s) image URLs are fetched (EPD_ALLOWED_MEDIA_DOMAINS, comma-
    # separated; a leading "." admits subdomains). Empty: no URL is fetched.
    allowed_media_domains: tuple[str, ...] = ()
    # Also fetch from private, loopback and link-local addresses (off: refused even when
    # an allowed name resolves to one).
    allow_private_media: bool = False
    # file:// image URLs are read only under this folder. Empty: refused.
    allowed_local_media_path: str = ""
    # One image fetch (connect, redirects and body) may take this long.
    media_timeout_s: float = 10.0
    # Requests in progress on this gateway before new ones get 429 / RESOURCE_EXHAUSTED.
    max_inflight: int = 1024
    # How the fleet's instances are chosen (gateway/policies.py): least_loaded,
    # power_of_two, round_robin, random, consistent_hash (on the session key: the
    # x-session-id header, else `user`) or prefix_aware (prefill goes where the prompt's
    # prefix was prefilled last; README has the comparison that made it the default).
    router_policy: str = "prefix_aware"
    # Times one request may move to another instance after its worker died (Dynamo's
    # --migration-limit). 0: a dead worker fails its requests.
    migration_limit: int = 3
    # This gateway's requests on one instance (per role) before it counts as full; when
    # every instance of a role is full, new requests get 429 / RESOURCE_EXHAUSTED.
    max_inflight_per_instance: int = 256
    # Conditional disaggregation (Dynamo's): a text prompt whose part not cached on the
    # chosen decode instance is at most this many tokens prefills on that instance,
    # skipping the prefill hop and the KV transfer. 0: always disaggregate.
    max_local_prefill_tokens: int = 0
    # Circuit breaker: an instance that failed this many dispatches in a row is skipped
    # for breaker_cooloff_s.
    breaker_failures: int = 3
    breaker_cooloff_s: float = 10.0
    # The semantic router's YAML file (EPD_ROUTER_CONFIG; docs/router.md): "auto" and the
    # other virtual model names it declares are routed, every request guarded; the file
    # is validated at start and reloaded when it changes. Empty: no router.
    router_config: str = ""

    def __post_init__(self) -> None:
        self.api_key = tuple(self.api_key)
        self.models = tuple(self.models)
        self.allowed_media_domains = tuple(d.lower() for d in self.allowed_media_domains)
        if not 0 <= self.http_port < 65536:
            raise ValueError("http_port must be in 0..65535")
        for name in (
            "max_n",
            "max_stop",
            "max_stop_chars",
            "max_stop_token_ids",
            "max_images",
            "max_image_bytes",
            "max_image_pixels",
            "max_body_mb",
            "max_inflight",
            "max_inflight_per_instance",
            "breaker_failures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.media_timeout_s <= 0 or self.breaker_cooloff_s <= 0:
            raise ValueError("media_timeout_s and breaker_cooloff_s must be > 0")
        if self.migration_limit < 0 or self.max_local_prefill_tokens < 0:
            raise ValueError("migration_limit and max_local_prefill_tokens must be >= 0")
        if self.router_policy not in POLICIES:
            raise ValueError(
                f"router_policy must be one of {', '.join(POLICIES)}, got {self.router_policy!r}"
            )
        if any(not k for k in self.api_key):
            raise ValueError("api_key entries must be non-empty")
