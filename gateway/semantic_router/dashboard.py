"""The router's recent decisions as the dashboard shows them (``GET
/dashboard/api/router``). Like the rest of the dashboard: no prompt, no answer, no key;
only what was decided, by which signals, and how long it took."""

from __future__ import annotations

from gateway.semantic_router.router import SemanticRouter

_ROWS = 50


def decisions_document(router: SemanticRouter | None, rows: int = _ROWS) -> dict:
    """The newest ``rows`` decisions, newest first, and the totals by route and guard."""
    if router is None:
        return {"enabled": False, "decisions": [], "routes": {}, "guards": {}}
    recent = list(router.recent)
    routes: dict[str, int] = {}
    guards: dict[str, int] = {}
    for d in recent:
        routes[d.route or "none"] = routes.get(d.route or "none", 0) + 1
        guards[d.guard.header] = guards.get(d.guard.header, 0) + 1
    out = [
        {
            "at": round(d.at, 3),
            "requested": d.requested,
            "model": d.model,
            "route": d.route or "none",
            "signals": d.signals,
            "guard": d.guard.header,
            "guard_reason": d.guard.kinds
            or ([d.guard.reason] if d.guard.action == "block" else []),
            "embedding": d.embedding,
            "ms": round(d.seconds * 1e3, 2),
        }
        for d in reversed(recent[-rows:])
    ]
    return {
        "enabled": True,
        "virtual_models": sorted(router.state.virtual),
        "decisions": out,
        "routes": routes,
        "guards": guards,
    }
