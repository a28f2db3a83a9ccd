"""Observability settings, and structured logs: text or one JSON object per line, every line about a request
carrying its (gateway-internal) request id, secrets masked (DESIGN.md "Running").

The request id travels in a context variable: the gateway sets it once it has made the
internal id (``GatewayCore.prepare``), the workers in their handlers; tasks started from
there inherit it. The service and instance of a line come from the same mechanism
(``Service.start`` binds them), so several services in one process (the in-process test
fleets) still label their own lines; threads without a context (the engine thread) get
the process's identity from ``configure``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from services.settings import Settings, setting
from services.urls import redact

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("epd_request_id", default="")
_IDENTITY: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "epd_identity", default=None
)
_process_identity: tuple[str, str] = ("", "")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


@dataclass
class ObservabilityConfig(Settings):
    """How a process logs and where it serves its metrics."""

    log_level: str = setting(
        "INFO", doc="`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`.", choices=_LEVELS
    )
    log_format: str = setting(
        "text",
        doc="`text` (human-readable lines) or `json` (one object per line: time, level, "
        "service, instance, request_id, logger, message).",
        choices=("text", "json"),
    )
    metrics_port: int | None = setting(
        None,
        doc="Port of this process's Prometheus `/metrics` (0: any free port). Unset: no "
        "metrics server (the gateway still answers `/metrics` on its REST port).",
        ge=0,
        le=65535,
    )

    def normalize(self) -> None:
        self.log_level = self.log_level.upper()


def bind_request(request_id: str) -> None:
    """This task (and the tasks it starts from now on) works for ``request_id``."""
    REQUEST_ID.set(request_id)


@contextlib.contextmanager
def identity(service: str, instance: str) -> Iterator[None]:
    """Lines logged inside (and by tasks started inside) belong to this service."""
    token = _IDENTITY.set((service, instance))
    try:
        yield
    finally:
        _IDENTITY.reset(token)


def set_process_identity(service: str, instance: str = "") -> None:
    """The identity of lines logged where no service bound one (threads, start-up)."""
    global _process_identity
    _process_identity = (service, instance)


class ContextFilter(logging.Filter):
    """Adds ``request_id``, ``service`` and ``instance`` to every record (an explicit
    ``extra={"request_id": ...}`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = REQUEST_ID.get()
        service, instance = _IDENTITY.get() or _process_identity
        if not getattr(record, "service", ""):
            record.service = service
        if not getattr(record, "instance", ""):
            record.instance = instance
        return True


class RedactingFormatter(logging.Formatter):
    """Text lines with every URL password, token and secret parameter masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line, secrets masked."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": getattr(record, "service", ""),
            "instance": getattr(record, "instance", ""),
            "request_id": getattr(record, "request_id", ""),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False)


def make_handler(config: ObservabilityConfig, stream=None) -> logging.Handler:
    """A handler that writes ``config``'s format (tests attach one to capture lines)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    fmt = JsonFormatter() if config.log_format == "json" else RedactingFormatter(TEXT_FORMAT)
    handler.setFormatter(fmt)
    return handler


def configure(config: ObservabilityConfig, service: str = "", instance: str = "") -> None:
    """The root logger writes ``config``'s format to stderr (replacing its handlers)."""
    set_process_identity(service, instance)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(config))
    root.setLevel(config.log_level)
