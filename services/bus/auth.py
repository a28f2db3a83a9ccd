"""Who a process is to NATS and how the link is secured: credentials and TLS.

``NatsAuth`` is part of ``BusConfig``. Credentials written into server URLs
(``nats://user:pw@host``, ``nats://token@host``) are moved out of the URLs into
``NatsAuth`` when the ``BusConfig`` is built, so that no URL the client holds (and so no
log line, error or server list printed from it) carries a secret, and so that servers
the cluster announces later (which come without userinfo) get the same credentials.
"""

from __future__ import annotations

import importlib.util
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.urls import split_userinfo


@dataclass(frozen=True)
class NatsAuth:
    """NATS credentials and TLS files; secrets never appear in ``repr``."""

    # User and password (server ``authorization { users = [...] }``).
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    # A bare token (server ``authorization { token: ... }``).
    token: str | None = field(default=None, repr=False)
    # A ``.creds`` file (user JWT + nkey seed) for operator/account (decentralised) auth.
    creds_file: str | None = None
    # A file holding a user nkey seed ("SU..."), for servers that list nkey users.
    nkey_seed_file: str | None = None
    # PEM CA bundle that signed the server's certificate (else the system CAs).
    tls_ca: str | None = None
    # PEM client certificate and its key, for servers that verify clients (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and not self.user:
            raise ValueError("a NATS password needs a user")
        if self.user is not None and not self.password:
            raise ValueError("a NATS user needs a non-empty password (a lone name is a token)")
        if self.token is not None and (self.user or not self.token):
            raise ValueError("give a NATS token or a user and password, not both; no empty token")
        if self.creds_file and self.nkey_seed_file:
            raise ValueError("give a NATS creds file or an nkey seed file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("the NATS TLS client certificate and key go together")
        if (self.creds_file or self.nkey_seed_file) and not importlib.util.find_spec("nkeys"):
            # nats-py imports it only while connecting; say so now, not as an ImportError
            # in the middle of a reconnect.
            raise ValueError("NATS creds / nkey seed files need the 'nkeys' package")

    @property
    def uses_tls(self) -> bool:
        """True when any TLS file is set (TLS is then required, even for nats:// URLs)."""
        return bool(self.tls_ca or self.tls_cert)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context verifying the server (CA given, else system CAs); None
        when no TLS file is set (nats-py then uses its default for tls:// servers)."""
        if not self.uses_tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def client_options(self, before_secret: Callable[[], None] = lambda: None) -> dict[str, object]:
        """The nats-py ``connect()`` keyword arguments for these credentials and TLS.

        nats-py reads a callable user, password or token while it writes CONNECT, after
        any TLS upgrade: ``before_secret`` runs then and may raise to keep the secret
        off a connection that should have been TLS and is not.
        """
        options: dict[str, object] = {}
        if self.user:
            options.update(
                user=_guarded(self.user, before_secret),
                password=_guarded(self.password or "", before_secret),
            )
        if self.token:
            options["token"] = _guarded(self.token, before_secret)
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        ctx = self.ssl_context()
        if ctx is not None:
            options["tls"] = ctx
        return options

    def missing_files(self) -> list[str]:
        """The configured files that do not exist (for a clear error at start-up)."""
        files = (self.creds_file, self.nkey_seed_file, self.tls_ca, self.tls_cert, self.tls_key)
        return [f for f in files if f and not Path(f).is_file()]


def _guarded(value: str, before: Callable[[], None]) -> Callable[[], str]:
    def get() -> str:
        before()
        return value

    return get


def take_url_credentials(
    servers: tuple[str, ...], auth: NatsAuth
) -> tuple[tuple[str, ...], NatsAuth]:
    """Servers without userinfo, and ``auth`` with the URLs' credentials added.

    All URLs that carry credentials must carry the same ones, and they must not clash
    with credentials given separately: one process has one identity on the bus.
    """
    clean, found = [], set()
    for url in servers:
        stripped, user, password = split_userinfo(url)
        clean.append(stripped)
        if user is not None:
            found.add((user, password))
    if not found:
        return tuple(clean), auth
    if len(found) > 1:
        raise ValueError("NATS server URLs carry different credentials")
    if auth.user or auth.token:
        raise ValueError("NATS credentials given both in a URL and separately")
    user, password = found.pop()
    if password is None:
        return tuple(clean), replace(auth, token=user)
    return tuple(clean), replace(auth, user=user, password=password)
