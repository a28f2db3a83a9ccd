"""The one way this project opens Redis: a URL (with its password and TLS) -> a client.

Supported URLs (checked by ``check_redis_url`` at start-up, so a typo fails there):

- ``redis://[[user]:password@]host[:port][/db]``, ``unix:///path/redis.sock[?db=N]``
- ``rediss://...`` (TLS) with redis-py's own query parameters: ``ssl_ca_certs`` (PEM
  CA bundle; else the system CAs), ``ssl_certfile`` + ``ssl_keyfile`` (client
  certificate, for ``tls-auth-clients yes``), ``ssl_cert_reqs`` (none | optional |
  required), ``ssl_check_hostname`` (true | false)
- ``redis+sentinel://[[user]:password@]host1:26379,host2:26379/<master-name>[/db]``
  (``rediss+sentinel://`` for TLS, same query parameters): the Sentinels are asked
  where the master is, and asked again after a failover. The userinfo authenticates to
  the master; ``sentinel_username`` / ``sentinel_password`` query parameters
  authenticate to the Sentinels themselves (Sentinel's own ``requirepass``).

Percent-encode special characters in passwords (``@`` -> ``%40``). Callers pass their
timeouts and retry policy; no other query parameter is accepted, so a URL cannot
quietly lengthen a timeout the caller relies on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from services.urls import redact

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
TLS_PARAMS = (*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname")
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _query(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def check_redis_url(url: str) -> None:
    """ValueError (with the password masked) unless ``url`` is one this module opens."""
    scheme = urlsplit(url).scheme
    if scheme not in PLAIN_SCHEMES + SENTINEL_SCHEMES:
        raise ValueError(
            f"redis URL must be redis://, rediss://, unix:// or redis+sentinel://"
            f" (rediss+sentinel://), got {redact(url)!r}"
        )
    query = _query(url)
    allowed = {"db", *TLS_PARAMS, *(_SENTINEL_AUTH if scheme in SENTINEL_SCHEMES else ())}
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ValueError(f"redis URL: unsupported query parameters {unknown} in {redact(url)!r}")
    tls = scheme.startswith("rediss")
    if not tls and set(query) & set(TLS_PARAMS):
        raise ValueError(f"redis URL: ssl_* parameters need rediss://, got {redact(url)!r}")
    if bool(query.get("ssl_certfile")) != bool(query.get("ssl_keyfile")):
        raise ValueError("redis URL: ssl_certfile and ssl_keyfile go together")
    missing = [query[k] for k in TLS_FILES if query.get(k) and not Path(query[k]).is_file()]
    if missing:
        raise ValueError(f"redis URL: TLS files not found: {missing}")
    if query.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise ValueError("redis URL: ssl_cert_reqs must be none, optional or required")
    if query.get("ssl_check_hostname", "true").lower() not in _TRUE + _FALSE:
        raise ValueError("redis URL: ssl_check_hostname must be true or false")
    if scheme in SENTINEL_SCHEMES:
        sentinel_address(url)  # raises on a malformed host list or path


def sentinel_address(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """(the Sentinels' (host, port) pairs, the master's name, the db) of a Sentinel URL."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    sentinels = []
    for hostport in netloc.split(","):
        host, _, port = hostport.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis sentinel URL: need host:port pairs, got {hostport!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [unquote(p) for p in urlsplit(url).path.split("/") if p]
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("redis sentinel URL: the path is /<master-name>[/<db>]")
    db = int(path[1]) if len(path) == 2 else int(_query(url).get("db", 0))
    return sentinels, path[0], db


def _tls_kwargs(query: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"ssl": True}
    out.update({k: query[k] for k in TLS_FILES + ("ssl_cert_reqs",) if query.get(k)})
    if "ssl_check_hostname" in query:
        out["ssl_check_hostname"] = query["ssl_check_hostname"].lower() in _TRUE
    return out


class _SentinelRedis(aioredis.Redis):
    """A master client that also closes its Sentinel clients on ``aclose``."""

    sentinel: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in self.sentinel.sentinels if self.sentinel else ():
            await client.aclose()


def _sentinel_client(url: str, **options: Any) -> aioredis.Redis:
    sentinels, service, db = sentinel_address(url)
    parts, query = urlsplit(url), _query(url)
    tls = _tls_kwargs(query) if parts.scheme.startswith("rediss") else {}
    auth = {
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
    }
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel_kwargs = {
        **timeouts,
        **tls,
        "username": query.get("sentinel_username") or None,
        "password": query.get("sentinel_password") or None,
    }
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)
    client = sentinel.master_for(
        service, redis_class=_SentinelRedis, db=db, **auth, **tls, **options
    )
    client.sentinel = sentinel
    return client


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """A redis.asyncio client for ``url``; ``options`` (socket timeouts, retry, ...)
    go to every connection. Nothing connects until the first command."""
    check_redis_url(url)
    if urlsplit(url).scheme in SENTINEL_SCHEMES:
        return _sentinel_client(url, **options)
    return aioredis.Redis.from_url(url, **options)
