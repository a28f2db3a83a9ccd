"""The OpenAI-compatible REST app (FastAPI) on the same ``GatewayCore`` as gRPC.

Bodies are read and parsed here, not by FastAPI: the size limit (413), the content type
and malformed JSON get OpenAI-shaped 400s, and a large body is parsed off the event loop.
/openapi.json still publishes every request schema (docs/rest-api.md says why).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from gateway.core import GatewayCore
from gateway.dashboard.routes import add_dashboard_routes
from gateway.errors import RequestFailure, classify
from gateway.models import ModelSet
from gateway.prepare import InvalidRequest
from gateway.rest.chat import chat_completion
from gateway.rest.completions import completion
from gateway.rest.info import detokenize, model_card, tokenize
from gateway.rest.media import MediaLoader
from gateway.rest.middleware import BodyTooLarge, Call, GatewayMiddleware
from gateway.rest.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.rest.responses import error_response
from gateway.semantic_router.router import GuardBlocked

VERSION = "0.1.0"
_BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
# (validated body, the call's particulars) -> response
Handler = Callable[[BaseModel, Call], Awaitable[Response]]


def build_app(served: GatewayCore | ModelSet) -> GatewayMiddleware:
    """The ASGI app: the FastAPI app behind GatewayMiddleware, which also sends the
    POST endpoints straight to their handlers (FastAPI's routing and middleware stack
    cost ~0.3 ms a request; the routes stay in FastAPI for /openapi.json and /docs).
    ``served``: the models (a bare core: one model); the front-door settings (keys,
    body limit) are the default model's, which every model of a gateway shares."""
    models = ModelSet.of(served)
    core = models.default
    app = FastAPI(title="epd-serve", version=VERSION, openapi_url="/openapi.json", docs_url="/docs")
    direct = _post_routes(app, models)
    _get_routes(app, models)
    add_dashboard_routes(app, core, list(models), router=lambda: models.router)
    app.add_exception_handler(HTTPException, _http_error)
    app.openapi = lambda: _openapi(app)
    limit = core.config.max_body_mb << 20
    return GatewayMiddleware(app, api_keys=core.config.api_key, max_body_bytes=limit, direct=direct)


def _post_routes(app: FastAPI, models: ModelSet) -> dict[str, Callable]:
    media = MediaLoader(models.default.config)
    routes: list[tuple[str, type[BaseModel], Handler, str]] = [
        (
            "/v1/chat/completions",
            ChatCompletionRequest,
            lambda b, call: chat_completion(models, media, b, call),
            "Create a chat completion",
        ),
        (
            "/v1/completions",
            CompletionRequest,
            lambda b, call: completion(models, b, call),
            "Create a text completion",
        ),
        (
            "/tokenize",
            TokenizeRequest,
            lambda b, call: tokenize(models.lookup(b.model or ""), media, b, call.headers),
            "Tokenize",
        ),
        (
            "/detokenize",
            DetokenizeRequest,
            lambda b, call: detokenize(models.lookup(b.model or ""), b, call.headers),
            "Detokenize",
        ),
    ]
    direct = {}
    for path, model, handler, summary in routes:
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        body = {"required": True, "content": {"application/json": {"schema": ref}}}
        direct[path] = _endpoint(model, handler)
        app.add_api_route(
            path,
            direct[path],
            methods=["POST"],
            summary=summary,
            openapi_extra={"requestBody": body},
        )
    return direct


def _get_routes(app: FastAPI, models: ModelSet) -> None:
    @app.get("/v1/models", summary="List the models that have live instances")
    async def list_models(request: Request) -> Response:
        body = {"object": "list", "data": [model_card(core) for core in models.live()]}
        return JSONResponse(body, headers=_headers(request))

    @app.get("/v1/models/{model_id:path}", summary="Retrieve a model")
    async def get_model(model_id: str, request: Request) -> Response:
        if model_id not in models.names:
            failure = RequestFailure("NOT_FOUND", f"model {model_id!r} is not served here", "model")
            return error_response(failure, _headers(request))
        return JSONResponse(model_card(models.lookup(model_id)), headers=_headers(request))

    @app.get("/health", summary="200 when the gateway can serve, else 503")
    async def health() -> Response:
        if models.ready():
            return Response(status_code=200)
        return error_response(RequestFailure("UNAVAILABLE", "no worker is ready to serve"))

    @app.get("/version", summary="Server version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    @app.get("/metrics", summary="Prometheus metrics (epd_*)", include_in_schema=False)
    async def metrics() -> Response:
        for core in models:
            refresh = getattr(core.backend, "refresh_metrics", None)
            if refresh is not None:  # serve all: the engine's gauges, read now
                refresh()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _headers(request: Request) -> dict:
    return {"X-Request-Id": request.state.request_id}


def _endpoint(model: type[BaseModel], handler: Handler) -> Callable:
    """``handler`` behind body parsing; every failure answered in OpenAI's shape."""

    async def run(request: Request) -> Response:
        try:
            body = await _parse(request, model)
            return await handler(body, Call.of(request, _headers(request)))
        except BodyTooLarge as e:
            failure, extra = RequestFailure("PAYLOAD_TOO_LARGE", str(e)), {}
        except Exception as e:  # errors are values at the edge
            # A guard's refusal says so in headers too (x-epd-guard: block:jailbreak).
            failure, extra = classify(e), e.headers if isinstance(e, GuardBlocked) else {}
        return error_response(failure, {**_headers(request), **extra})

    return run


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The validated body; InvalidRequest naming the problem when it is not one."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise InvalidRequest(f"Content-Type must be application/json, got {ctype!r}")
    raw = await request.body()
    try:
        obj = await asyncio.to_thread(json.loads, raw) if len(raw) > 1 << 20 else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        text = err["msg"].removeprefix("Value error, ")
        where = ".".join(loc)
        raise InvalidRequest(f"{where}: {text}" if where else text, loc[0] if loc else None) from e


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods, in OpenAI's error shape."""
    code = "NOT_FOUND" if exc.status_code == 404 else "INVALID_ARGUMENT"
    failure = RequestFailure(code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(failure.openai_body(), status_code=exc.status_code)


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema
