"""Opening the nats-py client for a ``BusConfig``: reconnect policy, credentials, TLS,
logging callbacks, and a first connect that fails fast when the server says no."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client

from services.bus.errors import BusUnavailable
from services.urls import redact

if TYPE_CHECKING:
    from services.bus.connection import BusConfig

logger = logging.getLogger("services.bus.connection")


def is_refusal(exc: BaseException) -> bool:
    """True for errors that retrying cannot fix: rejected credentials, a failed TLS
    handshake, a TLS mismatch between client and server."""
    if isinstance(exc, ssl.SSLError | nats.errors.AuthorizationError):
        return True
    secure = (
        nats.errors.SecureConnRequiredError,
        nats.errors.SecureConnWantedError,
        nats.errors.SecureConnFailedError,
    )
    if isinstance(exc, secure):
        return True
    text = str(exc).lower()
    return isinstance(exc, nats.errors.Error) and ("authori" in text or "authenti" in text)


def describe(exc: BaseException) -> str:
    """Class and message, secrets masked (nats-py errors' repr drops the message)."""
    return redact(f"{type(exc).__name__}: {exc}")


def is_tls(nc: Client) -> bool:
    """Whether the client's current connection runs over TLS. nats-py has no public
    property for it; its transport keeps the asyncio writer that knows."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    return writer is not None and writer.get_extra_info("ssl_object") is not None


def wants_tls(config: BusConfig) -> bool:
    """TLS files given or a tls:// server: a plaintext connection is then refused
    (nats-py itself upgrades only when the server asks, so a server or a man in the
    middle that does not ask would get the credentials in clear)."""
    return config.auth.uses_tls or any(s.startswith("tls://") for s in config.servers)


def connect_options(
    config: BusConfig, nc: Client, refused: asyncio.Future[BaseException] | None = None
) -> dict[str, object]:
    """nats-py ``connect()`` arguments. ``refused`` gets the first refusal (see
    ``is_refusal``) seen before the first connection is up."""

    async def on_error(exc: Exception) -> None:
        if refused is not None and not refused.done() and is_refusal(exc):
            refused.set_result(exc)
        logger.warning("nats error name=%s: %s", config.name, describe(exc))

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            logger.warning("nats disconnected name=%s", config.name)

    async def on_reconnect() -> None:
        logger.info("nats reconnected name=%s", config.name)

    def before_secret() -> None:
        if wants_tls(config) and not is_tls(nc):
            raise nats.errors.SecureConnWantedError  # "secure connection not available"

    return {
        "servers": list(config.servers),
        "name": config.name,
        "connect_timeout": config.connect_timeout_s,
        "reconnect_time_wait": config.reconnect_wait_s,
        "max_reconnect_attempts": config.max_reconnect_attempts,
        "ping_interval": config.ping_interval_s,
        "drain_timeout": config.drain_timeout_s,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        **config.auth.client_options(before_secret),
    }


async def open_client(config: BusConfig) -> Client:
    """A connected client; BusUnavailable after ``connect_timeout_s``, or as soon as the
    server refuses us (nats-py would otherwise retry a wrong password until the timeout
    and report only that it timed out)."""
    missing = config.auth.missing_files()
    if missing:
        raise BusUnavailable(f"NATS credential / TLS files not found: {missing}")
    nc = Client()
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    connecting = asyncio.ensure_future(nc.connect(**connect_options(config, nc, refused)))
    where = f"NATS at {list(config.servers)}"  # the servers hold no userinfo (BusConfig)
    try:
        done, _ = await asyncio.wait(
            {connecting, refused},
            timeout=config.connect_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if connecting in done:
            connecting.result()  # raises what connect() raised
            if wants_tls(config) and not is_tls(nc):  # no credentials: nothing stopped it
                raise BusUnavailable(f"{where} did not offer TLS, which this client requires")
            return nc
        if refused in done:
            raise BusUnavailable(f"{where} refused the connection: {describe(refused.result())}")
        raise BusUnavailable(f"cannot connect to {where} within {config.connect_timeout_s}s")
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise BusUnavailable(f"cannot connect to {where}: {describe(exc)}") from exc
    finally:
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
        refused.cancel()
        if not nc.is_connected or (wants_tls(config) and not is_tls(nc)):
            await close_quietly(nc)


async def close_quietly(nc: Client) -> None:
    """Close without raising (used on failed connects and at the end of ``close``)."""
    if nc.is_closed:
        return
    try:
        await nc.close()
    except Exception as exc:  # closing must never raise
        logger.debug("nats close failed: %r", exc)
