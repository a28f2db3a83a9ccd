"""Every NATS subject and queue group used by epd-serve, in one place.

Several models share one bus, so every work subject names the model (its fingerprint):
work the router assigns goes to a per-instance subject under the model
(``epd.prefill.<fp>.<id>``, ``epd.decode.<fp>.<id>``, ``epd.encoder.<fp>.<id>``), so a
request can only reach an instance of its model, whatever the instance ids. The
semantic cache (``epd.cache.*``) is shared: its entries carry the answering model's
fingerprint. Payloads too large for
a message arrive chunked on one per-instance subject (``epd.kv.<id>`` for KV blocks,
``epd.blob.<id>`` for images and embeddings) and carry their transfer id inside the
frames, so the receiver subscribes once and no sender races a late subscription.
"""

from __future__ import annotations

import re
from typing import Final

PREFIX: Final = "epd"

# Roles that publish heartbeats.
ROLE_ENCODE: Final = "encode"
ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_GATEWAY: Final = "gateway"
ROLE_CACHE: Final = "cache"
ROLES: Final = frozenset({ROLE_ENCODE, ROLE_PREFILL, ROLE_DECODE, ROLE_GATEWAY, ROLE_CACHE})

# Shared work subjects (request/reply, queue groups).
CACHE_LOOKUP: Final = f"{PREFIX}.cache.lookup"
CACHE_STORE: Final = f"{PREFIX}.cache.store"
# Broadcast: every service drops the request.
ABORT: Final = f"{PREFIX}.abort"

# Queue groups: one delivery per group, spread over the replicas.
QUEUE_CACHE: Final = "epd-cache"

# One subject token: no dots, wildcards or whitespace.
_TOKEN_RE = re.compile(r"[A-Za-z0-9_\-]+")


def check_token(value: str, what: str = "subject token") -> str:
    """Return ``value`` if it is a valid single subject token, else raise ValueError."""
    if not isinstance(value, str) or not _TOKEN_RE.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '-' and '_'")
    return value


def cache(op: str) -> str:
    """Subject of a semantic-cache operation: ``epd.cache.<op>``."""
    return f"{PREFIX}.cache.{check_token(op, 'cache op')}"


def cache_lookup_at(instance_id: str) -> str:
    """Lookups for one cache replica: ``epd.cache.lookup.<id>`` (the full lookup after an
    exact miss goes to the replica already embedding its text)."""
    return f"{CACHE_LOOKUP}.{check_token(instance_id, 'instance id')}"


def prefill(model_fingerprint: str, instance_id: str) -> str:
    """Subject of one prefill instance of a model: ``epd.prefill.<fp>.<id>``."""
    return f"{PREFIX}.prefill.{_scoped(model_fingerprint, instance_id)}"


def decode(model_fingerprint: str, instance_id: str) -> str:
    """Subject of one decode instance of a model: ``epd.decode.<fp>.<id>``."""
    return f"{PREFIX}.decode.{_scoped(model_fingerprint, instance_id)}"


def encoder(model_fingerprint: str, instance_id: str) -> str:
    """Subject of one encoder instance of a model (images sent ahead as blobs):
    ``epd.encoder.<fp>.<id>``."""
    return f"{PREFIX}.encoder.{_scoped(model_fingerprint, instance_id)}"


def ping(instance_id: str) -> str:
    """Subject an engine instance answers while it lives: ``epd.ping.<id>``. A request
    there gets "no responders" as soon as the instance's connection is gone, long before
    its heartbeats expire."""
    return f"{PREFIX}.ping.{check_token(instance_id, 'instance id')}"


def blob(instance_id: str) -> str:
    """Subject where one instance receives chunked payloads (images, embeddings):
    ``epd.blob.<id>``."""
    return f"{PREFIX}.blob.{check_token(instance_id, 'instance id')}"


def kv(instance_id: str) -> str:
    """Subject where one decode instance receives chunked KV transfers: ``epd.kv.<id>``."""
    return f"{PREFIX}.kv.{check_token(instance_id, 'instance id')}"


def out(gateway_id: str) -> str:
    """Subject of one gateway's token batches: ``epd.out.<gateway-id>``."""
    return f"{PREFIX}.out.{check_token(gateway_id, 'gateway id')}"


def heartbeat(role: str, instance_id: str) -> str:
    """Subject of one instance's heartbeats: ``epd.hb.<role>.<id>``."""
    return f"{PREFIX}.hb.{_check_role(role)}.{check_token(instance_id, 'instance id')}"


def heartbeat_wildcard(role: str) -> str:
    """Subject matching every heartbeat of a role: ``epd.hb.<role>.*``."""
    return f"{PREFIX}.hb.{_check_role(role)}.*"


def _scoped(model_fingerprint: str, instance_id: str) -> str:
    """``<fp>.<id>``: an instance's tokens under its model."""
    fp = check_token(model_fingerprint, "model fingerprint")
    return f"{fp}.{check_token(instance_id, 'instance id')}"


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLES)}")
    return role
