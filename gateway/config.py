"""What the gateway's front doors accept: ports, API keys, request and media limits."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policies import POLICIES
from gateway.reasoning import REASONING_PARSERS
from gateway.tools import TOOL_PARSERS
from services.image_checks import MAX_IMAGE_PIXELS
from services.settings import Settings, setting


@dataclass
class GatewayConfig(Settings):
    """The gateway's own settings. Validated at construction."""

    models: tuple[str, ...] = setting(
        (),
        doc="The models this gateway serves over the fleet (comma-separated; on the command "
        "line `--model` repeated), the first being the default of requests that name none. "
        "Empty: the engine's one model (`EPD_MODEL`).",
        flags=("--model",),
    )
    http_port: int = setting(
        8000, doc="OpenAI-compatible REST port (0: any free port).", ge=0, le=65535
    )
    api_key: tuple[str, ...] = setting(
        (),
        doc="Bearer tokens accepted on `/v1/*` (comma-separated; the flag repeated). Empty: "
        "no auth. Kept out of logs.",
        secret=True,
    )
    max_n: int = setting(16, doc="Most choices per request (`n`).", ge=1)
    max_stop: int = setting(16, doc="Most stop strings per request.", ge=1)
    max_stop_chars: int = setting(256, doc="Longest stop string, in characters.", ge=1)
    max_stop_token_ids: int = setting(256, doc="Most `stop_token_ids` per request.", ge=1)
    max_images: int = setting(16, doc="Most images per request.", ge=1)
    max_image_bytes: int = setting(64 << 20, doc="Largest encoded image, bytes.", ge=1)
    max_image_pixels: int = setting(
        MAX_IMAGE_PIXELS, doc="Most pixels in one image (checked from its header).", ge=1
    )
    max_body_mb: int = setting(
        128,
        doc="Largest REST request body, MiB (a 20 MB image is ~27 MB as a base64 data URL).",
        ge=1,
    )
    allowed_media_domains: tuple[str, ...] = setting(
        (),
        doc="Hosts whose http(s) image URLs are fetched (comma-separated; the flag repeated; "
        "a leading `.` admits subdomains). Empty: no URL is fetched.",
    )
    allow_private_media: bool = setting(
        False,
        doc="Also fetch from private, loopback and link-local addresses (off: refused even "
        "when an allowed name resolves to one).",
    )
    allowed_local_media_path: str = setting(
        "", doc="`file://` image URLs are read only under this folder. Empty: refused."
    )
    media_timeout_s: float = setting(
        10.0, doc="Seconds one image fetch (connect, redirects and body) may take.", gt=0
    )
    max_inflight: int = setting(
        1024,
        doc="Requests in progress on this gateway before new ones get 429 / RESOURCE_EXHAUSTED.",
        ge=1,
    )
    router_policy: str = setting(
        "prefix_aware",
        doc="How the fleet's instances are chosen (gateway/policies.py): `prefix_aware` "
        "(prefill goes where the prompt's prefix was prefilled last), `least_loaded`, "
        "`power_of_two`, `round_robin`, `random` or `consistent_hash` (on the session key: "
        "the `x-session-id` header, else `user`).",
        choices=tuple(POLICIES),
    )
    migration_limit: int = setting(
        3,
        doc="Times one request may move to another instance after its worker died (Dynamo's "
        "`--migration-limit`). 0: a dead worker fails its requests.",
        ge=0,
    )
    max_inflight_per_instance: int = setting(
        256,
        doc="This gateway's requests on one instance (per role) before it counts as full; "
        "when every instance of a role is full, new requests get 429 / RESOURCE_EXHAUSTED.",
        ge=1,
    )
    max_local_prefill_tokens: int = setting(
        0,
        doc="Conditional disaggregation (Dynamo's): a text prompt whose part not cached on "
        "the chosen decode instance is at most this many tokens prefills on that instance, "
        "skipping the prefill hop and the KV transfer. 0: always disaggregate.",
        ge=0,
    )
    breaker_failures: int = setting(
        3,
        doc="Circuit breaker: an instance that failed this many dispatches in a row is "
        "skipped for `breaker_cooloff_s`.",
        ge=1,
    )
    breaker_cooloff_s: float = setting(
        10.0, doc="Seconds the circuit breaker skips a failing instance.", gt=0
    )
    router_config: str = setting(
        "",
        doc="The semantic router's YAML file (docs/router.md): `auto` and the other virtual "
        "model names it declares are routed, every request guarded; validated at start and "
        "reloaded when it changes. Empty: no router.",
    )

    tool_call_parser: str = setting(
        "",
        doc="How the model writes tool calls (vLLM's `--tool-call-parser`): `hermes` (Qwen 2.5, "
        "Hermes), `llama3_json`, `mistral` or `qwen3_coder` (Qwen3-Coder, Nemotron 3 Super). "
        "Calls are read back into `message.tool_calls`; `required` and a named `tool_choice` "
        "are enforced by grammar. Empty: requests that ask for tool calls get 400.",
        choices=("", *TOOL_PARSERS),
    )
    enable_auto_tool_choice: bool = setting(
        False,
        doc="Let the model decide whether to call a tool (`tool_choice: auto`, the default of "
        "a request with tools); a call it starts is enforced from its start tag on. Needs "
        "`tool_call_parser`.",
    )
    reasoning_parser: str = setting(
        "",
        doc="How a reasoning model writes its thinking (`deepseek_r1`, `qwen3`, "
        "`nemotron_v3`): it goes to `message.reasoning`, a constraint applies after it, and "
        "`thinking_token_budget` bounds it. Empty: the thinking stays in the content.",
        choices=("", *REASONING_PARSERS),
    )

    def normalize(self) -> None:
        self.api_key = tuple(self.api_key)
        self.models = tuple(self.models)
        self.allowed_media_domains = tuple(d.lower() for d in self.allowed_media_domains)

    def check(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        if any(not k for k in self.api_key):
            raise ValueError("api_key entries must be non-empty")
