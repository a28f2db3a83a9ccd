"""The dashboard's routes on the REST app: the page, its two assets and its JSON.

No API key, like /health: the page shows fleet state only (instance ids, load, latency
and cache figures), never a prompt, an answer or a key. The assets are read from the
package once, at app build, and served from memory; the page loads nothing else (no
CDN: users run this offline).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from gateway.core import GatewayCore
from gateway.dashboard.state import DashboardState
from gateway.semantic_router.dashboard import decisions_document

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The state changes every second: never cached. The assets are revalidated (no-cache), so
# a browser picks up an upgraded gateway's page.
_NO_STORE = {"Cache-Control": "no-store"}


def add_dashboard_routes(
    app: FastAPI,
    core: GatewayCore,
    cores: list[GatewayCore] | None = None,
    router: Callable[[], object] | None = None,
) -> None:
    """GET /dashboard, /dashboard/app.js, /dashboard/style.css, /dashboard/api/state and
    /dashboard/api/router. ``cores``: every model the gateway serves (``core``: the
    default one's); ``router``: the semantic router's hook, when there is one."""
    static = resources.files("gateway.dashboard") / "static"
    assets = {name: (static / name).read_bytes() for name in _TYPES}
    state = DashboardState(core, cores)

    def serve(name: str):
        async def asset() -> Response:
            return Response(
                assets[name], media_type=_TYPES[name], headers={"Cache-Control": "no-cache"}
            )

        return asset

    app.add_api_route("/dashboard", serve("index.html"), methods=["GET"], include_in_schema=False)
    for name in ("app.js", "style.css"):
        app.add_api_route(
            f"/dashboard/{name}", serve(name), methods=["GET"], include_in_schema=False
        )

    @app.get("/dashboard/api/state", include_in_schema=False)
    async def dashboard_state() -> Response:
        return JSONResponse(await state.document(), headers=_NO_STORE)

    @app.get("/dashboard/api/router", include_in_schema=False)
    async def dashboard_router() -> Response:
        hook = router() if router is not None else None
        doc = decisions_document(hook.router if hook is not None else None)
        return JSONResponse(doc, headers=_NO_STORE)
