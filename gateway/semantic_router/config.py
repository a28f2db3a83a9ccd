"""The router's YAML file (``--router-config`` / ``EPD_ROUTER_CONFIG``), validated.

Every field is checked when the file is read; a mistake is a ``RouterConfigError`` that
names the field (``routes[2].regex[0]: ...``), so a bad file is refused at start and a
bad edit is refused by the hot reload (the old config stays). docs/router.md has an
annotated example.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

GuardAction = Literal["allow", "redact", "block"]
PII_KINDS = ("email", "phone", "card", "iban")


class RouterConfigError(ValueError):
    """A router config that cannot be used; the message names the bad field."""


class _Strict(BaseModel):
    # A misspelt key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_regexes(patterns: list[str]) -> list[str]:
    for i, p in enumerate(patterns):
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"[{i}] {p!r} is not a valid regular expression: {e}") from e
    return patterns


class Features(_Strict):
    """Request features a route requires; every one that is set must hold."""

    # True: only requests with images; False: only requests without.
    has_images: bool | None = None
    # Prompt size bounds in estimated tokens (characters / 4: the router runs before the
    # target model's tokenizer), e.g. a long-context model takes min_prompt_tokens: 3000.
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    # True: only requests that send tools (function calling).
    tools: bool | None = None
    # True: only requests asking for JSON output (response_format json_object/json_schema).
    json_output: bool | None = Field(default=None, alias="json")

    def any_set(self) -> bool:
        """Whether the route requires anything at all."""
        return any(v is not None for v in self.model_dump().values())


class Route(_Strict):
    """One route: when its signals fire, ``model`` answers."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    # A concrete model name the gateway serves (not a virtual one).
    model: str = Field(min_length=1)
    # Higher wins when several routes match.
    priority: int = 0
    # Case-insensitive whole-word keywords (or phrases) in the last user message.
    keywords: list[str] = Field(default_factory=list)
    # Regular expressions searched in the last user message (case-insensitive).
    regex: list[str] = Field(default_factory=list)
    # Example utterances: the similarity signal compares the last user message with them.
    examples: list[str] = Field(default_factory=list)
    # Request features that must hold for the route to match at all.
    when: Features = Field(default_factory=Features)

    @field_validator("regex")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        return _check_regexes(patterns)

    @field_validator("keywords", "examples")
    @classmethod
    def _no_blank(cls, values: list[str]) -> list[str]:
        for i, v in enumerate(values):
            if not v.strip():
                raise ValueError(f"[{i}] is empty")
        return values


class Similarity(_Strict):
    """The embedding-similarity signal."""

    # centroid: cosine to the mean of each route's examples; topk: the k most similar
    # examples vote, each weighted by its cosine.
    method: Literal["centroid", "topk"] = "topk"
    k: int = Field(default=5, ge=1, le=100)
    # Below this cosine (best example or centroid) the similarity signal stays silent.
    threshold: float = Field(default=0.45, gt=0.0, le=1.0)


class PatternRule(_Strict):
    """An extra PII pattern (e.g. an internal account number)."""

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    regex: str

    @field_validator("regex")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        return _check_regexes([pattern])[0]


def phone_numbers_installed() -> bool:
    """Phone numbers need ``phonenumbers``, the ``pii`` extra (``epd-serve[pii]``)."""
    return importlib.util.find_spec("phonenumbers") is not None


def _default_pii_kinds() -> list[str]:
    # A config that names no kinds gets every kind this install can detect.
    return [k for k in PII_KINDS if k != "phone" or phone_numbers_installed()]


class PiiGuard(_Strict):
    """Personal data in the user's messages."""

    action: GuardAction = "allow"
    kinds: list[Literal["email", "phone", "card", "iban"]] = Field(
        default_factory=_default_pii_kinds
    )
    # Regions whose national phone formats are recognised (international +NN numbers
    # always are).
    phone_regions: list[str] = Field(default_factory=lambda: ["US", "GB"])
    patterns: list[PatternRule] = Field(default_factory=list)

    @field_validator("kinds")
    @classmethod
    def _phone_needs_its_extra(cls, kinds: list[str]) -> list[str]:
        if "phone" in kinds and not phone_numbers_installed():
            raise ValueError(
                "'phone' needs the phonenumbers package: pip install 'epd-serve[pii]' "
                "(or leave 'phone' out of kinds)"
            )
        return kinds


class JailbreakGuard(_Strict):
    """Jailbreak and prompt-injection attempts."""

    action: Literal["allow", "block"] = "block"
    # Cosine to the nearest known attack prompt at or above which a message is one.
    threshold: float = Field(default=0.80, gt=0.0, le=1.0)
    # Phrase rules ("ignore previous instructions", role-play overrides, base64 blobs).
    heuristics: bool = True
    # Extra attack prompts of your own, added to the shipped set.
    extra_examples: list[str] = Field(default_factory=list)


class Guards(_Strict):
    pii: PiiGuard = Field(default_factory=PiiGuard)
    jailbreak: JailbreakGuard = Field(default_factory=JailbreakGuard)
    # Guard requests that name a concrete model too (not only the routed ones).
    all_requests: bool = True


class RouterConfig(_Strict):
    """The whole file."""

    # Model names that go through the router (a concrete name bypasses it).
    virtual_models: list[str] = Field(default_factory=lambda: ["auto"], min_length=1)
    routes: list[Route] = Field(min_length=1)
    # The route taken when no other matches.
    default_route: str
    similarity: Similarity = Field(default_factory=Similarity)
    guards: Guards = Field(default_factory=Guards)
    # How long the router waits for the cache service's embedding; past it the request
    # is routed without the similarity signals.
    embed_timeout_ms: float = Field(default=250.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> RouterConfig:
        names = [r.name for r in self.routes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"routes: duplicate route names {sorted(dup)}")
        if self.default_route not in names:
            raise ValueError(
                f"default_route: {self.default_route!r} is not a route (routes: {', '.join(names)})"
            )
        virtual = set(self.virtual_models)
        for i, r in enumerate(self.routes):
            if r.model in virtual:
                raise ValueError(f"routes[{i}].model: {r.model!r} is a virtual model name")
        return self

    def route(self, name: str) -> Route:
        return next(r for r in self.routes if r.name == name)


def parse_config(text: str, source: str = "<router config>") -> RouterConfig:
    """A validated RouterConfig from YAML text; RouterConfigError naming the bad field."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RouterConfigError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise RouterConfigError(f"{source}: the top level must be a mapping")
    try:
        return RouterConfig.model_validate(raw)
    except ValidationError as e:
        raise RouterConfigError(f"{source}: {_first_error(e)}") from e


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a config file (RouterConfigError when unreadable or invalid)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RouterConfigError(f"{path}: cannot read the router config: {e}") from e
    return parse_config(text, str(path))


def check_models(config: RouterConfig, served: list[str]) -> None:
    """RouterConfigError when a route names a model this gateway does not serve, or a
    virtual name hides a served one."""
    for i, r in enumerate(config.routes):
        if r.model not in served:
            raise RouterConfigError(
                f"routes[{i}].model: {r.model!r} is not served by this "
                f"gateway (serving: {', '.join(served)})"
            )
    for name in config.virtual_models:
        if name in served:
            raise RouterConfigError(f"virtual_models: {name!r} is a served model's name")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {msg}{more}" if where else f"{msg}{more}"
