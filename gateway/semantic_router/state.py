"""One loaded config, compiled: keyword and regex matchers, the PII detector, and the
example and attack-prompt vectors (embedded once per load through the cache service).

If the cache service cannot embed at load time the state still routes by keywords,
regexes and features and guards by heuristics; ``missing_vectors`` tells the reloader to
try the embeddings again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np

from gateway.semantic_router.config import Route, RouterConfig
from gateway.semantic_router.embedding import Embedder
from gateway.semantic_router.jailbreak import AttackIndex, shipped_prompts
from gateway.semantic_router.pii import PiiDetector
from gateway.semantic_router.similarity import RouteIndex

log = logging.getLogger(__name__)

# A config load may embed a few hundred examples: give it longer than one request.
_LOAD_TIMEOUT_S = 10.0


@dataclass
class RouteMatcher:
    """A route's lexical signals, compiled."""

    route: Route
    keywords: re.Pattern | None
    regexes: list[re.Pattern]

    @classmethod
    def of(cls, route: Route) -> RouteMatcher:
        # Word edges by look-around, not \b: keywords such as "c++" end in a non-word char.
        words = "|".join(re.escape(k) for k in sorted(route.keywords, key=len, reverse=True))
        kw = re.compile(rf"(?<!\w)(?:{words})(?!\w)", re.I) if words else None
        return cls(route, kw, [re.compile(p, re.I) for p in route.regex])

    def lexical(self, text: str) -> str | None:
        """The keyword or regex signal that fires on ``text``, named, or None."""
        if self.keywords is not None and (m := self.keywords.search(text)):
            return f"keyword:{m.group().lower()}"
        for i, rx in enumerate(self.regexes):
            if rx.search(text):
                return f"regex:{i}"
        return None


@dataclass
class RouterState:
    """Everything a decision reads; replaced whole on reload (never mutated in place)."""

    config: RouterConfig
    matchers: list[RouteMatcher]
    pii: PiiDetector
    routes: RouteIndex | None = None
    attacks: AttackIndex | None = None
    missing_vectors: bool = False
    virtual: frozenset[str] = field(default_factory=frozenset)

    def wants_vectors(self) -> bool:
        """Whether the config uses embeddings at all."""
        return any(r.examples for r in self.config.routes) or self.jailbreak_similarity()

    def jailbreak_similarity(self) -> bool:
        return self.config.guards.jailbreak.action != "allow"


def attack_prompts(config: RouterConfig) -> list[str]:
    return shipped_prompts() + list(config.guards.jailbreak.extra_examples)


async def compile_state(config: RouterConfig, embedder: Embedder | None) -> RouterState:
    """The state of ``config``; vectors from ``embedder`` (None: lexical signals only)."""
    state = RouterState(
        config,
        [RouteMatcher.of(r) for r in config.routes],
        PiiDetector(config.guards.pii),
        virtual=frozenset(config.virtual_models),
    )
    if state.wants_vectors():
        state.missing_vectors = True
        if embedder is not None:
            await add_vectors(state, embedder)
    return state


async def add_vectors(state: RouterState, embedder: Embedder) -> bool:
    """Embed the examples and attack prompts into ``state``; False (logged) on failure."""
    labelled = [(r.name, ex) for r in state.config.routes for ex in r.examples]
    attacks = attack_prompts(state.config) if state.jailbreak_similarity() else []
    texts = [ex for _, ex in labelled] + attacks
    try:
        vectors = await embedder.embed(texts, _LOAD_TIMEOUT_S)
    except Exception as e:  # routed without similarity until the reloader retries
        log.warning(
            "router: cannot embed %d examples yet (%s); similarity signals off",
            len(texts),
            e or type(e).__name__,
        )
        return False
    n = len(labelled)
    if n:
        state.routes = RouteIndex([r for r, _ in labelled], vectors[:n], state.config.similarity)
    state.attacks = AttackIndex(vectors[n:]) if attacks else None
    state.missing_vectors = False
    log.info("router: %d examples and %d attack prompts embedded", n, len(attacks))
    return True


def nearest_attack(state: RouterState, vec: np.ndarray | None) -> float:
    """Cosine of the message to the nearest known attack prompt (0 without vectors)."""
    if vec is None or state.attacks is None:
        return 0.0
    return state.attacks.nearest(vec)
