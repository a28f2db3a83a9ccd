"""The OpenAI-compatible REST app (FastAPI) on the same ``GatewayCore`` as gRPC.

Bodies are read and parsed here, not by FastAPI: the size limit (413), the content type
and malformed JSON get OpenAI-shaped 400s, and a large body is parsed off the event loop.
/openapi.json still publishes every request schema.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from gateway.core import GatewayCore
from gateway.errors import RequestFailure, classify
from gateway.rest.chat import chat_completion, resolve_messages
from gateway.rest.completions import completion
from gateway.rest.media import MediaLoader
from gateway.rest.middleware import BodyTooLarge, GatewayMiddleware, client_request_id
from gateway.rest.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Unsupported,
)
from gateway.rest.responses import error_response
from services.chat import render_chat

VERSION = "0.1.0"
_BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def _bad(message: str, param: str | None = None) -> RequestFailure:
    return RequestFailure("INVALID_ARGUMENT", message, param)


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The validated body; RequestFailure (as an exception) when it is not."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise _Refused(_bad(f"Content-Type must be application/json, got {ctype!r}"))
    raw = await request.body()
    try:
        obj = await asyncio.to_thread(json.loads, raw) if len(raw) > 1 << 20 else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Refused(_bad(f"the body is not valid JSON: {e}")) from e
    if not isinstance(obj, dict):
        raise _Refused(_bad("the body must be a JSON object"))
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        text = err["msg"].removeprefix("Value error, ")
        where = ".".join(loc)
        raise _Refused(_bad(f"{where}: {text}" if where else text, loc[0] if loc else None)) from e


class _Refused(Exception):
    def __init__(self, failure: RequestFailure):
        super().__init__(failure.message)
        self.failure = failure


def build_app(core: GatewayCore) -> GatewayMiddleware:
    """The ASGI app: the FastAPI app behind GatewayMiddleware, which also sends the
    completion endpoints straight to their handlers (FastAPI's routing and middleware
    stack cost ~0.3 ms a request; the routes stay in FastAPI for /openapi.json)."""
    config = core.config
    media = MediaLoader(config)
    app = FastAPI(title="epd-serve", version=VERSION, openapi_url="/openapi.json", docs_url="/docs")
    direct: dict[str, Callable] = {}

    def headers_of(request: Request) -> dict:
        return {"X-Request-Id": request.state.request_id}

    def endpoint(model: type[BaseModel], handler: Callable):
        async def run(request: Request) -> Response:
            try:
                body = await _parse(request, model)
                return await handler(body, client_request_id(request), headers_of(request))
            except _Refused as e:
                return error_response(e.failure, headers_of(request))
            except Unsupported as e:
                return error_response(_bad(str(e), e.param), headers_of(request))
            except BodyTooLarge as e:
                return error_response(
                    RequestFailure("PAYLOAD_TOO_LARGE", str(e)), headers_of(request)
                )
            except Exception as e:  # errors are values at the edge
                return error_response(classify(e), headers_of(request))

        return run

    def route(path: str, model: type[BaseModel], handler: Callable, summary: str) -> None:
        body_schema = {"$ref": f"#/components/schemas/{model.__name__}"}
        extra = {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body_schema}},
            }
        }
        direct[path] = endpoint(model, handler)
        app.add_api_route(path, direct[path], methods=["POST"], summary=summary,
                          openapi_extra=extra)  # fmt: skip

    route("/v1/chat/completions", ChatCompletionRequest,
          lambda b, cid, h: chat_completion(core, media, b, cid, h), "Create a chat completion")  # fmt: skip
    route("/v1/completions", CompletionRequest, lambda b, cid, h: completion(core, b, cid, h),
          "Create a text completion")  # fmt: skip
    route("/tokenize", TokenizeRequest, lambda b, cid, h: _tokenize(core, b, h), "Tokenize")
    route("/detokenize", DetokenizeRequest, lambda b, cid, h: _detokenize(core, b, h), "Detokenize")

    @app.get("/v1/models", summary="List models")
    async def list_models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [_model_card(core)]}, headers=headers_of(request)
        )

    @app.get("/v1/models/{model_id:path}", summary="Retrieve a model")
    async def get_model(model_id: str, request: Request) -> Response:
        if model_id != core.info.model_id:
            failure = RequestFailure("NOT_FOUND", f"model {model_id!r} is not served here", "model")
            return error_response(failure, headers_of(request))
        return JSONResponse(_model_card(core), headers=headers_of(request))

    @app.get("/health", summary="200 when the gateway can serve, else 503")
    async def health() -> Response:
        if core.backend.ready():
            return Response(status_code=200)
        return error_response(RequestFailure("UNAVAILABLE", "no worker is ready to serve"))

    @app.get("/version", summary="Server version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "NOT_FOUND", 405: "INVALID_ARGUMENT"}.get(exc.status_code, "INVALID_ARGUMENT")
        failure = RequestFailure(code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(failure.openai_body(), status_code=exc.status_code)

    app.openapi = lambda: _openapi(app)
    return GatewayMiddleware(app, api_keys=config.api_key, max_body_bytes=config.max_body_mb << 20,
                             direct=direct)  # fmt: skip


def _model_card(core: GatewayCore) -> dict:
    info = core.info
    return {"id": info.model_id, "object": "model", "created": int(time.time()),
            "owned_by": "epd-serve", "root": info.model_id, "max_model_len": info.max_model_len,
            "vision": info.vision}  # fmt: skip


async def _tokenize(core: GatewayCore, req: TokenizeRequest, headers: dict) -> Response:
    core.preparer.check_model(req.model or "")
    tok = core.tokenizer
    if req.messages is not None:
        messages = await resolve_messages(None, req.messages)
        text, _ = render_chat(tok, messages, req.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    image_id, per_image = core.info.image_token_id, core.info.tokens_per_image
    if image_id is not None and per_image > 1:  # as the model sees them: one id per image token
        ids = [t for i in ids for t in ([i] * per_image if i == image_id else [i])]
    body = {"count": len(ids), "max_model_len": core.info.max_model_len, "tokens": ids}
    return JSONResponse(body, headers=headers)


async def _detokenize(core: GatewayCore, req: DetokenizeRequest, headers: dict) -> Response:
    core.preparer.check_model(req.model or "")
    vocab = core.info.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise _Refused(_bad(f"tokens must be ids in [0, {vocab})", "tokens"))
    return JSONResponse({"prompt": core.tokenizer.decode(req.tokens)}, headers=headers)


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
