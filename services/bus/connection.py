"""The process-wide NATS connection: typed request/reply, publish, resilient subscribe.

One ``Bus`` per process. Handlers receive an ``Incoming`` message; an exception in a
handler is logged, answered with an error header when the sender waits for a reply (so
the requester fails fast with RemoteError instead of timing out), and never stops the
subscription.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field

import nats.errors
from google.protobuf.message import Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.bus.auth import NatsAuth, take_url_credentials
from services.bus.client_options import close_quietly, open_client
from services.bus.errors import (
    BusError,
    BusTimeout,
    BusUnavailable,
    NoResponders,
    PayloadTooLarge,
    RemoteError,
)
from services.bus.handlers import ERROR_HEADER, Handler, HandlerRunner, Incoming
from services.bus.messages import M, decode, encode
from services.metrics import BUS_REQUEST_SECONDS, subject_kind

logger = logging.getLogger(__name__)

__all__ = ["ERROR_HEADER", "Bus", "BusConfig", "Handler", "Incoming", "NatsAuth"]


@dataclass(frozen=True)
class BusConfig:
    """How a process connects to NATS. Validated at construction."""

    # NATS server URLs; the client fails over between them.
    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    # Connection name shown by the server's monitoring (e.g. "decode-0").
    name: str = "epd"
    # Limit on the first connection (all servers, all attempts).
    connect_timeout_s: float = 5.0
    # Pause between reconnect attempts to one server.
    reconnect_wait_s: float = 0.5
    # Reconnect attempts per server before giving up; -1 retries forever.
    max_reconnect_attempts: int = -1
    # Client pings the server this often to detect dead connections.
    ping_interval_s: float = 10.0
    # Limit on draining subscriptions and in-flight handlers at close().
    drain_timeout_s: float = 5.0
    # A request answered "no responders" is retried (with backoff) for this long: the
    # server can report no interest for a few ms after another client's SUB was
    # acknowledged (seen with nats-server 2.15), e.g. right after an instance starts.
    no_responders_grace_s: float = 0.1
    # Credentials and TLS; userinfo in ``servers`` is moved here at construction.
    auth: NatsAuth = field(default_factory=NatsAuth)

    def __post_init__(self) -> None:
        servers, auth = take_url_credentials(tuple(self.servers), self.auth)
        object.__setattr__(self, "servers", servers)  # frozen: the one place it changes
        object.__setattr__(self, "auth", auth)
        if not self.servers or not all(s.startswith(("nats://", "tls://")) for s in self.servers):
            raise ValueError(f"servers must be nats:// or tls:// URLs, got {self.servers}")
        for name in ("connect_timeout_s", "reconnect_wait_s", "ping_interval_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_reconnect_attempts < -1:
            raise ValueError("max_reconnect_attempts must be >= -1")
        if self.no_responders_grace_s < 0:
            raise ValueError("no_responders_grace_s must be >= 0")


class Bus:
    """One NATS connection with protobuf payloads and timeouts on every wait."""

    def __init__(self, nc: Client, config: BusConfig) -> None:
        """Wrap a connected client; use ``await Bus.connect(config)``."""
        self._nc = nc
        self._config = config
        self._runners: list[tuple[Subscription, HandlerRunner]] = []
        self._closed = False

    @classmethod
    async def connect(cls, config: BusConfig | None = None) -> Bus:
        """Connect to NATS; raise BusUnavailable after ``connect_timeout_s``, or at once
        when the server rejects the credentials or the TLS handshake fails."""
        config = config or BusConfig()
        nc = await open_client(config)
        url = nc.connected_url.geturl() if nc.connected_url else "?"  # holds no userinfo
        logger.info("bus connected name=%s url=%s", config.name, url)
        return cls(nc, config)

    @property
    def config(self) -> BusConfig:
        """The configuration this bus was connected with (read-only)."""
        return self._config

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts, in bytes."""
        return self._nc.max_payload

    @property
    def is_connected(self) -> bool:
        """True while connected (False while reconnecting or after close)."""
        return self._nc.is_connected

    @property
    def client(self) -> Client:
        """The underlying nats-py client (escape hatch; prefer the Bus methods)."""
        return self._nc

    def new_inbox(self) -> str:
        """A unique subject for replies."""
        return self._nc.new_inbox()

    async def publish(
        self,
        subject: str,
        msg: Message | bytes,
        *,
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Publish one message (fire and forget)."""
        self._check_open()
        try:
            await self._nc.publish(subject, encode(msg), reply=reply, headers=headers)
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLarge(f"message to {subject!r} exceeds max_payload") from exc
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusUnavailable(f"cannot publish to {subject!r}: {exc!r}") from exc

    async def request(
        self,
        subject: str,
        msg: Message | bytes,
        reply_type: type[M],
        timeout_s: float,
        *,
        headers: dict[str, str] | None = None,
    ) -> M:
        """Send a request and decode the reply as ``reply_type``.

        Raises BusTimeout (no reply in time), NoResponders (nobody subscribed),
        RemoteError (the handler failed), MessageDecodeError (malformed reply).
        """
        self._check_open()
        if timeout_s <= 0:
            raise BusTimeout(f"request to {subject!r}", timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        retry_until = loop.time() + min(self._config.no_responders_grace_s, timeout_s)
        delay = 0.005
        payload = encode(msg)
        started = loop.time()
        try:
            while True:
                try:
                    reply = await self._request_once(
                        subject, payload, deadline - loop.time(), headers
                    )
                    break
                except NoResponders:
                    if loop.time() + delay > retry_until:
                        raise
                    await asyncio.sleep(delay)
                    delay *= 2
        finally:
            BUS_REQUEST_SECONDS.labels(subject_kind(subject)).observe(loop.time() - started)
        error = (reply.headers or {}).get(ERROR_HEADER)
        if error is not None:
            raise RemoteError(subject, error)
        return decode(reply.data, reply_type)

    async def _request_once(
        self, subject: str, payload: bytes, timeout_s: float, headers: dict[str, str] | None
    ) -> Msg:
        try:
            return await self._nc.request(subject, payload, timeout=timeout_s, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(subject) from exc
        except nats.errors.TimeoutError as exc:
            raise BusTimeout(f"request to {subject!r}", timeout_s) from exc
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLarge(f"request to {subject!r} exceeds max_payload") from exc
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusUnavailable(f"cannot request {subject!r}: {exc!r}") from exc

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        max_concurrency: int = 1,
        pending_bytes_limit: int | None = None,
    ) -> Subscription:
        """Run ``handler`` for every message on ``subject`` (wildcards allowed).

        ``queue`` joins a queue group (one replica gets each message).
        ``max_concurrency`` > 1 runs that many handler calls at once; messages beyond it
        wait in the client's pending buffer (``pending_bytes_limit``).
        """
        self._check_open()
        runner = HandlerRunner(self, subject, handler, max_concurrency)
        kwargs = {} if pending_bytes_limit is None else {"pending_bytes_limit": pending_bytes_limit}
        sub = await self._nc.subscribe(subject, queue=queue or "", cb=runner.handle, **kwargs)
        self._runners.append((sub, runner))
        return sub

    async def subscribe_queue(self, subject: str) -> tuple[Subscription, asyncio.Queue[Msg]]:
        """Subscribe and deliver raw messages into an asyncio.Queue (for reply inboxes)."""
        self._check_open()
        box: asyncio.Queue[Msg] = asyncio.Queue()

        async def put(msg: Msg) -> None:
            box.put_nowait(msg)

        return await self._nc.subscribe(subject, cb=put), box

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has processed everything sent so far."""
        try:
            await self._nc.flush(timeout=timeout_s)
        except nats.errors.FlushTimeoutError as exc:
            raise BusTimeout("flush", timeout_s) from exc

    async def close(self) -> None:
        """Stop intake, let in-flight handlers finish (bounded), flush and close.

        Safe to call twice.
        """
        if self._closed:
            return
        self._closed = True
        grace = self._config.drain_timeout_s
        subs = [sub for sub, _ in self._runners]
        await _bounded(asyncio.gather(*(_drain_sub(s) for s in subs)), grace, "drain subs")
        await _bounded(
            asyncio.gather(*(r.wait_idle() for _, r in self._runners)), grace, "handlers"
        )
        try:
            await asyncio.wait_for(self._nc.drain(), timeout=grace)
        except (TimeoutError, nats.errors.Error) as exc:
            logger.warning("bus drain failed, closing: %r", exc)
        await close_quietly(self._nc)
        logger.info("bus closed name=%s", self._config.name)

    def _check_open(self) -> None:
        if self._closed:
            raise BusUnavailable("bus is closed")


async def _drain_sub(sub: Subscription) -> None:
    try:
        await sub.drain()
    except (nats.errors.Error, BusError) as exc:
        logger.debug("subscription drain failed: %r", exc)


async def _bounded(aw: Awaitable[object], timeout_s: float, what: str) -> None:
    try:
        await asyncio.wait_for(aw, timeout=timeout_s)
    except TimeoutError:
        logger.warning("bus close: %s did not finish within %.1fs", what, timeout_s)
