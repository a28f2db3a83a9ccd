"""The models one gateway serves, and the one place a request's ``model`` becomes the
model that answers it (``ModelSet.resolve``).

Every model has its own ``GatewayCore``: its tokenizer and chat template, its limits
(context length, vocabulary), its router over the instances of that model, its slice of
the semantic cache (keyed by that model's fingerprint). The REST app and the gRPC server
hold a ``ModelSet`` and ask it for the core of each request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.core import GatewayCore
from gateway.events import BackendError
from gateway.prepare import ModelNotFoundError, PreparedRequest
from services.metrics import REQUESTS


class UnknownModel(ModelNotFoundError):
    """No model of that name here (404 / NOT_FOUND, OpenAI's ``model_not_found``)."""


class ModelUnavailable(BackendError):
    """A model served here whose instances are all gone (503 / UNAVAILABLE)."""

    def __init__(self, name: str):
        super().__init__("UNAVAILABLE", f"model {name!r} has no live instance; retry later")
        self.model = name


@dataclass
class ModelRequest:
    """What the resolver may look at besides the name: the request as the gateway
    prepares it (``messages`` as chat dicts, images as bytes parts; or ``prompt``)."""

    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    images: list[bytes] = field(default_factory=list)
    tenant: str = ""
    session_key: str = ""


# Maps a name that is no concrete model (e.g. "auto", a virtual model of the semantic
# router) and the request to a concrete model name; None: the name is unknown.
VirtualResolver = Callable[[str, ModelRequest | None], str | None]


class ModelSet:
    """The gateway's models by name; the first is the default (a request without a
    ``model`` gets it, as a one-model gateway always did)."""

    def __init__(self, cores: Iterable[GatewayCore]):
        self._cores: dict[str, GatewayCore] = {}
        for core in cores:
            name = core.info.model_id
            if name in self._cores:
                raise ValueError(f"model {name!r} is given twice (model names must differ)")
            self._cores[name] = core
        if not self._cores:
            raise ValueError("a gateway serves at least one model")
        self.default = next(iter(self._cores.values()))
        # The semantic router's hook (gateway/semantic_router/): consulted only for
        # names that are no concrete model.
        self.virtual: VirtualResolver | None = None
        # The semantic router's request hook (gateway/semantic_router/hook.py RouterHook):
        # guards every request and turns a virtual name into a concrete one, in prepare.
        self.router = None

    @classmethod
    def of(cls, served: GatewayCore | ModelSet) -> ModelSet:
        """``served`` as a ModelSet (a bare core: a one-model set)."""
        return served if isinstance(served, ModelSet) else cls([served])

    def __iter__(self):
        return iter(self._cores.values())

    def __len__(self) -> int:
        return len(self._cores)

    @property
    def names(self) -> list[str]:
        return list(self._cores)

    def lookup(self, name: str) -> GatewayCore:
        """The core of a concrete model name ("" : the default), live or not (tokenize,
        model cards); UnknownModel otherwise."""
        if not name:
            return self.default
        core = self._cores.get(name)
        if core is None:
            raise UnknownModel(
                f"the model {name!r} does not exist (served here: {', '.join(self._cores)})"
            )
        return core

    def check_name(self, name: str) -> None:
        """UnknownModel, early (before images are fetched), for a name that is neither a
        model here nor possibly virtual (no semantic router is hooked in)."""
        if self.virtual is None:
            self.lookup(name)

    def resolve(self, name: str, request: ModelRequest | None = None) -> GatewayCore:
        """The core that answers a request naming ``name``.

        A concrete model name (or "" for the default) is taken as is; any other name
        goes to ``self.virtual`` (the semantic router: ``"auto"``, virtual models) with
        the request, and must come back as a concrete name. Raises UnknownModel (404 /
        NOT_FOUND) for a name nobody knows, ModelUnavailable (503 / UNAVAILABLE) for a
        model with no live instance. Guards may raise InvalidRequest (400) from the hook.
        """
        if name and name not in self._cores and self.virtual is not None:
            routed = self.virtual(name, request)
            if routed is not None:
                name = routed
        core = self.lookup(name)
        if not serving(core):
            raise ModelUnavailable(core.info.model_id)
        return core

    async def prepare(self, **kwargs) -> tuple[GatewayCore, PreparedRequest]:
        """``resolve`` the request's ``model``, check that core's capacity and prepare
        the request on it (GatewayCore.prepare's keywords). The semantic router, when
        hooked in, sees the request first (it may redact it, route it, or refuse it)."""
        headers: dict[str, str] = {}
        vector = b""
        if self.router is not None:
            kwargs, headers, vector = await self.router.apply(kwargs)
        request = ModelRequest(
            kwargs.get("messages"),
            kwargs.get("prompt"),
            kwargs.get("prompt_token_ids"),
            list(kwargs.get("images") or ()),
            kwargs.get("tenant", ""),
            kwargs.get("session_key", ""),
        )
        core = self.resolve(kwargs.get("model") or "", request)
        self.check_capacity()
        core.check_capacity()
        kwargs["model"] = core.info.model_id
        prep = await core.prepare(**kwargs)
        prep.route_headers = {**headers, "x-epd-model": core.info.model_id}
        prep.text_vector = vector
        return core, prep

    def check_capacity(self) -> None:
        """RESOURCE_EXHAUSTED when the gateway (every model together) already has
        ``max_inflight`` requests in progress."""
        total, limit = sum(c.inflight for c in self), self.default.config.max_inflight
        if total >= limit:
            REQUESTS.labels("rejected").inc()
            raise BackendError(
                "RESOURCE_EXHAUSTED",
                f"the server is at capacity ({total} requests in progress); retry later",
            )

    def live(self) -> list[GatewayCore]:
        """Models that have live instances now (what /v1/models and ListModels list)."""
        return [core for core in self._cores.values() if serving(core)]

    def ready(self) -> bool:
        """Health: some model can serve."""
        return any(core.backend.ready() for core in self._cores.values())


def serving(core: GatewayCore) -> bool:
    """The core's backend has live instances for a text request (a fleet backend says
    so with ``serving()``; else ``ready()``)."""
    check = getattr(core.backend, "serving", None) or core.backend.ready
    return bool(check())
