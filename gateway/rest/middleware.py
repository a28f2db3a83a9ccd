"""What every REST request goes through first (plain ASGI, no per-request task): its
X-Request-Id (echoed, or generated), the API key on /v1/*, the body size limit; then the
hot POST endpoints straight to their handlers, everything else to FastAPI."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from gateway.errors import RequestFailure


class BodyTooLarge(Exception):
    """The request body grew past the limit while it was read."""


@dataclass
class Call:
    """What a handler needs to know about the HTTP call besides its body."""

    client_id: str | None  # the client's own X-Request-Id (only ever echoed back)
    headers: dict  # for the response
    cache_mode: str  # the x-epd-cache header: default, no-cache, no-store or bypass
    api_key: str  # the bearer token that passed (part of the cache tenant), or ""
    session: str = ""  # the x-session-id header: the consistent_hash routing key

    @classmethod
    def of(cls, request: Request, headers: dict) -> Call:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
        return cls(
            request.headers.get("x-request-id"),
            headers,
            request.headers.get("x-epd-cache", "default").strip().lower(),
            key,
            request.headers.get("x-session-id", ""),
        )

    def tenant(self, user: str | None) -> str:
        """Whose cached answers this call may share: its API key's, and its ``user``'s."""
        key = hashlib.sha256(self.api_key.encode()).hexdigest()[:16] if self.api_key else ""
        return f"{key}:{user or ''}" if key or user else ""


class GatewayMiddleware:
    def __init__(
        self,
        app,
        api_keys: tuple[str, ...],
        max_body_bytes: int,
        direct: dict[str, Callable] | None = None,
    ):
        """``direct``: POST path -> ``async (Request) -> Response``, served without
        FastAPI's routing (``app`` serves every other request)."""
        self.app = app
        self.direct = direct or {}
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        if self.api_keys and scope["path"].startswith("/v1/") and not self._authorized(headers):
            failure = RequestFailure(
                "UNAUTHENTICATED", "a valid API key is required (Authorization: Bearer <key>)"
            )
            return await _reply(send, failure, rid, {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _reply(send, self._too_large(), rid)
        receive, send = self._limited(receive), self._tagged(send, rid)
        handler = self.direct.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        ok = scheme.lower() == b"bearer" and bool(token)
        return ok and any(hmac.compare_digest(token, key) for key in self.api_keys)

    def _too_large(self) -> RequestFailure:
        return RequestFailure(
            "PAYLOAD_TOO_LARGE", f"the request body is over {self.max_body_bytes} bytes"
        )

    def _limited(self, receive):
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise BodyTooLarge(self._too_large().message)
            return message

        return limited

    @staticmethod
    def _tagged(send, rid: str):
        async def tagged(message):
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                if b"x-request-id" not in names:
                    message.setdefault("headers", []).append(
                        (b"x-request-id", rid.encode("latin-1"))
                    )
            await send(message)

        return tagged


async def _reply(send, failure: RequestFailure, rid: str, extra: dict | None = None) -> None:
    body = json.dumps(failure.openai_body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode("latin-1")),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": failure.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
