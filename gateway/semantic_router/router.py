"""The semantic router: guards first, then signals to a route, then the route's model.

``decide`` runs for every request the gateway hands it: a virtual model name ("auto")
is routed, a concrete one only guarded (when ``guards.all_requests``). Order: PII (a
redaction changes what every later signal reads), jailbreak heuristics, then one
embedding of the last user message (the cache service's model), which feeds both the
jailbreak similarity and the route similarity; then keyword, regex and feature signals.
Among the routes whose signals fire, the highest priority wins (ties: the stronger
signal); none: the default route.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gateway.semantic_router.config import Features
from gateway.semantic_router.embedding import Embedder
from gateway.semantic_router.guards import (
    GuardOutcome,
    check_jailbreak_heuristics,
    check_jailbreak_similarity,
    check_pii,
)
from gateway.semantic_router.request import RequestView, view_of_messages, view_of_prompt
from gateway.semantic_router.state import RouterState, nearest_attack
from services.metrics import ROUTER_DECISIONS, ROUTER_EMBEDDINGS, ROUTER_GUARD, ROUTER_SECONDS

log = logging.getLogger(__name__)
_RECENT = 200  # decisions kept for the dashboard


class GuardBlocked(ValueError):
    """A guard refused the request (the gateway answers 400 / INVALID_ARGUMENT)."""

    def __init__(self, decision: Decision):
        super().__init__(decision.guard.reason)
        self.decision = decision

    @property
    def headers(self) -> dict[str, str]:
        """The 400's headers: what was asked for and which guard refused it."""
        return {
            "x-epd-guard": self.decision.guard.header,
            "x-epd-route": self.decision.route or "none",
        }


@dataclass
class Decision:
    """What the router did with one request (headers, metrics, the dashboard)."""

    requested: str  # the model name the client sent
    model: str  # the model that serves it (the requested one when not routed)
    route: str = ""  # "" when not routed (a concrete model name)
    signals: list[str] = field(default_factory=list)  # what chose the route
    guard: GuardOutcome = field(default_factory=GuardOutcome)
    embedding: str = "skipped"  # "ok", "unavailable" or "skipped"
    # The last user message's vector (after any redaction), when it was embedded: the
    # semantic cache reuses it instead of embedding the same text again.
    vector: np.ndarray | None = None
    seconds: float = 0.0
    at: float = field(default_factory=time.time)

    def headers(self) -> dict[str, str]:
        """x-epd-model, x-epd-route and x-epd-guard."""
        return {
            "x-epd-model": self.model,
            "x-epd-route": self.route or "none",
            "x-epd-guard": self.guard.header,
        }


class SemanticRouter:
    """Decisions over the current RouterState (swapped whole by the reloader)."""

    def __init__(self, state: RouterState, embedder: Embedder | None):
        self.state = state
        self.embedder = embedder
        self.recent: deque[Decision] = deque(maxlen=_RECENT)

    def routes(self, model: str) -> bool:
        """Whether ``model`` is a virtual name that this router resolves."""
        return model in self.state.virtual

    def handles(self, model: str) -> bool:
        """Whether a request for ``model`` goes through ``decide`` at all."""
        return self.routes(model) or self.state.config.guards.all_requests

    async def decide(
        self,
        model: str,
        messages: list[dict] | None = None,
        prompt: str | None = None,
        *,
        tools: bool = False,
        json_output: bool = False,
        images: int = 0,
    ) -> Decision:
        """The decision for one request; GuardBlocked when a guard refuses it. A redacted
        request's new messages (or prompt) are in ``decision.guard``."""
        started = time.perf_counter()
        state = self.state  # one config for the whole decision, whatever a reload does
        decision = Decision(requested=model, model=model)
        decision.guard = check_pii(state, messages, prompt)
        if decision.guard.action == "redact":
            messages, prompt = decision.guard.messages, decision.guard.prompt or prompt
        if messages is not None:
            view = view_of_messages(messages, tools=tools, json_output=json_output, images=images)
        else:
            view = view_of_prompt(prompt or "", images)
        try:
            await self._decide(state, view, decision)
        finally:
            decision.seconds = time.perf_counter() - started
            self._record(decision)
        return decision

    async def _decide(self, state: RouterState, view: RequestView, decision: Decision) -> None:
        if decision.guard.action != "block":
            jb = check_jailbreak_heuristics(state, view.user_texts)
            decision.guard = jb if jb.action == "block" else decision.guard
        if decision.guard.action == "block":
            raise GuardBlocked(decision)
        vec = await self._embed(state, view, decision)
        jb = check_jailbreak_similarity(state, nearest_attack(state, vec))
        if jb.action == "block":
            decision.guard = jb
            raise GuardBlocked(decision)
        if self.routes(decision.requested):
            decision.route, decision.signals = choose_route(state, view, vec)
            decision.model = state.config.route(decision.route).model

    async def _embed(
        self, state: RouterState, view: RequestView, decision: Decision
    ) -> np.ndarray | None:
        """The last user message's vector when a similarity signal can use it."""
        useful = state.attacks is not None or (
            state.routes is not None and self.routes(decision.requested)
        )
        if not view.text or not useful or self.embedder is None:
            return None
        try:
            timeout_s = state.config.embed_timeout_ms / 1e3
            (vec,) = await self.embedder.embed([view.text], timeout_s)
        except Exception as e:  # slow or gone: decided without similarity
            log.info(
                "router: no embedding (%s); deciding without similarity", e or type(e).__name__
            )
            decision.embedding = "unavailable"
            ROUTER_EMBEDDINGS.labels("unavailable").inc()
            return None
        decision.embedding, decision.vector = "ok", vec
        ROUTER_EMBEDDINGS.labels("ok").inc()
        return vec

    def _record(self, decision: Decision) -> None:
        ROUTER_SECONDS.observe(decision.seconds)
        if decision.guard.guard:
            ROUTER_GUARD.labels(decision.guard.guard, decision.guard.action).inc()
        if decision.route:
            ROUTER_DECISIONS.labels(decision.route, decision.model).inc()
        self.recent.append(decision)


def features_hold(when: Features, view: RequestView) -> bool:
    """Whether every feature the route requires holds for the request."""
    checks = (
        (when.has_images, lambda: view.has_images == when.has_images),
        (when.tools, lambda: view.tools == when.tools),
        (when.json_output, lambda: view.json_output == when.json_output),
        (when.min_prompt_tokens, lambda: view.prompt_tokens >= when.min_prompt_tokens),
        (when.max_prompt_tokens, lambda: view.prompt_tokens <= when.max_prompt_tokens),
    )
    return all(check() for value, check in checks if value is not None)


def choose_route(
    state: RouterState, view: RequestView, vec: np.ndarray | None
) -> tuple[str, list[str]]:
    """(route name, the signals that chose it): highest priority among the routes whose
    features hold and whose keyword, regex or similarity signal fires (a route with only
    feature conditions fires on them); ties go to the stronger signal."""
    vote = state.routes.vote(vec) if state.routes is not None and vec is not None else None
    best: tuple[int, float, str, list[str]] | None = None
    for m in state.matchers:
        route = m.route
        if not features_hold(route.when, view):
            continue
        signals, strength = [], 0.0
        lexical = m.lexical(view.text) if view.text else None
        if lexical:
            signals.append(lexical)
            strength = 1.0
        if vote is not None and vote.route == route.name:
            signals.append(f"similarity:{vote.score:.2f}")
            strength = max(strength, vote.score)
        if not (route.keywords or route.regex or route.examples) and route.when.any_set():
            signals.append("features")
            strength = 1.0
        if signals and (best is None or (route.priority, strength) > best[:2]):
            best = (route.priority, strength, route.name, signals)
    if best is None:
        return state.config.default_route, ["default"]
    return best[2], best[3]
