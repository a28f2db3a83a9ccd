"""One table maps every failure to a gRPC code and an HTTP status in OpenAI's shape."""

from __future__ import annotations

import pytest

from gateway.errors import classify
from gateway.events import BackendError
from gateway.prepare import InvalidRequest, ModelNotFoundError
from gateway.rest.protocol import Unsupported


@pytest.mark.parametrize(
    "error,code,status,param",
    [
        (BackendError("UNAVAILABLE", "no live decode instance"), "UNAVAILABLE", 503, None),
        (BackendError("RESOURCE_EXHAUSTED", "at capacity"), "RESOURCE_EXHAUSTED", 429, None),
        (BackendError("DEADLINE_EXCEEDED", "late"), "DEADLINE_EXCEEDED", 504, None),
        (ModelNotFoundError("no such model"), "NOT_FOUND", 404, "model"),
        (InvalidRequest("too many stop strings", "stop"), "INVALID_ARGUMENT", 400, "stop"),
        (Unsupported("tools", "tool calling"), "INVALID_ARGUMENT", 400, "tools"),
        (
            ValueError("temperature must be in [0, 100], got -1"),
            "INVALID_ARGUMENT",
            400,
            "temperature",
        ),
        (
            ValueError("prompt needs 99 KV blocks; the pool has 8"),
            "INVALID_ARGUMENT",
            400,
            "prompt",
        ),
        (RuntimeError("boom"), "INTERNAL", 500, None),
    ],
)
def test_classify(error, code, status, param):
    failure = classify(error)
    assert (failure.code, failure.http_status, failure.param) == (code, status, param)
    body = failure.openai_body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
