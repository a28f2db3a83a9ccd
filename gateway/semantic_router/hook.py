"""Where the router meets the gateway: ``ModelSet.prepare`` hands it each request.

``RouterHook.apply`` runs the guards and, for a virtual model name, the routing; it
returns the request's keywords with the concrete model (and redacted messages or
prompt) and the response headers that say what happened. ``resolve_name`` is the
synchronous ``ModelSet.virtual`` resolver for the paths that only need a model's
tokenizer (``/tokenize`` with ``model: "auto"``): the default route's model.
"""

from __future__ import annotations

from gateway.semantic_router.embedding import BusEmbedder, Embedder, LocalEmbedder
from gateway.semantic_router.reload import RouterReloader, open_router
from gateway.semantic_router.router import SemanticRouter


class RouterHook:
    """The semantic router as the gateway's model resolver."""

    def __init__(self, router: SemanticRouter):
        self.router = router

    def resolve_name(self, name: str, request=None) -> str | None:
        """A virtual name's model without a decision (the default route's); None for a
        name nobody knows."""
        state = self.router.state
        if name not in state.virtual:
            return None
        return state.config.route(state.config.default_route).model

    async def apply(self, kwargs: dict) -> tuple[dict, dict[str, str], bytes]:
        """(the keywords for ``GatewayCore.prepare``, headers, the last user message's
        embedding as float32 bytes or b""). GuardBlocked (400) when a guard refuses it."""
        model = kwargs.get("model") or ""
        if not self.router.handles(model):
            return kwargs, {}, b""
        images = len(kwargs.get("images") or ())
        decision = await self.router.decide(
            model, kwargs.get("messages"), kwargs.get("prompt"), images=images
        )
        out = dict(kwargs)
        out["model"] = decision.model
        if decision.guard.action == "redact":
            if decision.guard.messages is not None:
                out["messages"] = decision.guard.messages
            if decision.guard.prompt is not None:
                out["prompt"] = decision.guard.prompt
        vector = b"" if decision.vector is None else decision.vector.astype("<f4").tobytes()
        return out, decision.headers(), vector


def embedder_for(bus, local_cache) -> Embedder | None:
    """The cache service over the bus (fleet), else the semantic cache's own model in this
    process (``serve all``), else none (keyword, regex and feature signals only)."""
    if bus is not None:
        return BusEmbedder(bus)
    if local_cache is not None:
        return LocalEmbedder(local_cache.embed.embed)
    return None


async def start_router(path: str, models, embedder: Embedder | None) -> RouterReloader:
    """Load and validate ``path`` against the served models (RouterConfigError stops the
    gateway), hook the router into ``models`` and start watching the file."""
    router = await open_router(path, embedder, models.names)
    hook = RouterHook(router)
    models.router, models.virtual = hook, hook.resolve_name
    reloader = RouterReloader(router, path, served=models.names)
    reloader.start()
    return reloader
