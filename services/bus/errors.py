"""Errors raised by the bus layer (callers catch BusError for all of them)."""

from __future__ import annotations


class BusError(Exception):
    """Base class of every bus failure."""


class BusUnavailable(BusError):
    """Not connected to NATS (never connected, closed, or giving up reconnecting)."""


class BusTimeout(BusError, TimeoutError):
    """A wait on the bus ran past its timeout or deadline."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what}: no answer within {timeout_s:.3f}s")
        self.what = what
        self.timeout_s = timeout_s


class NoResponders(BusError):
    """A request found no subscriber on its subject (no instance is serving it)."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject!r}")
        self.subject = subject


class PayloadTooLarge(BusError, ValueError):
    """A message exceeds the server's max_payload (use services.bus.chunked)."""


class RemoteError(BusError):
    """The responder's handler failed and answered with an error instead of a reply."""

    def __init__(self, subject: str, message: str) -> None:
        super().__init__(f"handler on {subject!r} failed: {message}")
        self.subject = subject
        self.remote_message = message


class TransferError(BusError):
    """A chunked transfer failed (refused, out of order, wrong size, receiver gave up)."""


class TransferTimeout(TransferError, BusTimeout):
    """A chunked transfer did not progress within its timeout."""
