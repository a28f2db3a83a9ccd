"""What the gateway refuses before any work starts (gateway/errors.py maps them to
statuses)."""

from __future__ import annotations


class ModelNotFoundError(LookupError):
    """The request names a model this deployment does not serve."""


class InvalidRequest(ValueError):
    """A request the gateway refuses; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
