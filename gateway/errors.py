"""Every failure of a request, once, as a status: a gRPC code and an HTTP status with
OpenAI's error type (STYLE.md 11: errors are values at the edge)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.events import BackendError
from gateway.prepare import InvalidRequest, ModelNotFoundError

log = logging.getLogger(__name__)

# gRPC status name -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "NOT_FOUND": (404, "invalid_request_error", "model_not_found"),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PAYLOAD_TOO_LARGE": (413, "invalid_request_error", "request_too_large"),  # REST only
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
    "ABORTED": (503, "server_error", "aborted"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
    "INTERNAL": (500, "server_error", None),
}

# Request fields a validation message may start with (SamplingParams names its field).
_PARAMS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "logprobs",
        "prompt",
        "messages",
    }
)


@dataclass(frozen=True)
class RequestFailure:
    """How one failed request is reported."""

    code: str  # grpc.StatusCode name
    message: str
    param: str | None = None

    @property
    def http_status(self) -> int:
        return _HTTP.get(self.code, _HTTP["INTERNAL"])[0]

    def openai_body(self) -> dict:
        _, kind, code = _HTTP.get(self.code, _HTTP["INTERNAL"])
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


def classify(e: BaseException, request_id: str = "") -> RequestFailure:
    """The status of an exception raised while serving a request."""
    if isinstance(e, BackendError):
        return RequestFailure(e.code, e.message)
    if isinstance(e, ModelNotFoundError):
        return RequestFailure("NOT_FOUND", str(e), "model")
    if isinstance(e, InvalidRequest):
        return RequestFailure("INVALID_ARGUMENT", str(e), e.param)
    if isinstance(e, ValueError | TypeError):  # bad values; the engine's refusals
        first = str(e).split(" ", 1)[0]
        return RequestFailure("INVALID_ARGUMENT", str(e), first if first in _PARAMS else None)
    log.error("request %s failed", request_id, exc_info=e)
    return RequestFailure("INTERNAL", f"internal error: {type(e).__name__}: {e}")
