"""Where the acks of chunked transfers arrive (sender side; protocol in chunked.py).

One long-lived wildcard reply subscription per Bus, routed by a per-transfer token (the
header's reply subject ends in ``h<n>``, the chunks' in ``c<n>``): no subscription per
transfer, and no ack lost to a subscription the server has not yet propagated.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.bus.connection import Bus
from services.bus.errors import BusUnavailable, TransferTimeout


class AckInbox:
    """One wildcard reply subscription per Bus, routing acks to transfers by token."""

    _of_bus: weakref.WeakKeyDictionary[Bus, AckInbox] = weakref.WeakKeyDictionary()

    def __init__(self, prefix: str) -> None:
        """An inbox for reply subjects ``<prefix>.*``; use ``await AckInbox.of(bus)``."""
        self._prefix = prefix
        self._routes: dict[str, Acks] = {}
        self._tokens = 0
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def of(cls, bus: Bus) -> AckInbox:
        """The bus's inbox, subscribed (and flushed) on first use."""
        inbox = cls._of_bus.get(bus)
        if inbox is None:
            inbox = cls._of_bus[bus] = cls(bus.new_inbox())
        if inbox._sub is None:
            async with inbox._lock:
                if inbox._sub is None:
                    await inbox._subscribe(bus)
        return inbox

    async def _subscribe(self, bus: Bus) -> None:
        # The raw client: Bus.subscribe's handler runner is more than routing needs.
        try:
            self._sub = await bus.client.subscribe(f"{self._prefix}.*", cb=self._route)
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusUnavailable(f"cannot subscribe to the chunk ack inbox: {exc!r}") from exc
        await bus.flush()  # so the first receiver's acks find the subscription

    def open(self) -> tuple[str, str, Acks]:
        """A new route: (header reply subject, chunk reply subject, its acks)."""
        self._tokens += 1
        token = str(self._tokens)
        acks = self._routes[token] = Acks()
        return f"{self._prefix}.h{token}", f"{self._prefix}.c{token}", acks

    def close(self, reply: str) -> None:
        """Drop the route of ``reply``; later acks to it are ignored."""
        self._routes.pop(reply.rpartition(".")[2][1:], None)

    async def _route(self, msg: Msg) -> None:
        acks = self._routes.get(msg.subject.rpartition(".")[2][1:])
        if acks is not None:
            acks.put(msg)


class Acks:
    """The replies to one transfer, in arrival order (a lighter asyncio.Queue)."""

    def __init__(self) -> None:
        """An empty queue with no waiter."""
        self._msgs: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, msg: Msg) -> None:
        """Queue ``msg`` and wake the waiter, if any."""
        self._msgs.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout_s: float, what: str) -> Msg:
        """The next reply; TransferTimeout when none comes within ``timeout_s``."""
        if not self._msgs:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                raise TransferTimeout(what, timeout_s) from None
            finally:
                self._waiter = None
        return self._msgs.popleft()
