"""The semantic router: picks the model for ``model: "auto"`` (and other virtual names
from its YAML config) by keyword, regex, embedding-similarity and request-feature
signals, and guards every request against PII and jailbreaks (docs/router.md)."""

from gateway.semantic_router.config import RouterConfig, RouterConfigError, load_config
from gateway.semantic_router.router import Decision, GuardBlocked, SemanticRouter

__all__ = [
    "Decision",
    "GuardBlocked",
    "RouterConfig",
    "RouterConfigError",
    "SemanticRouter",
    "load_config",
]
