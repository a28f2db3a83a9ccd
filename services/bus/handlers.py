"""Running subscription handlers: the Incoming message and the crash-proof runner."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from google.protobuf.message import Message
from nats.aio.msg import Msg

from services.bus.messages import M, decode

if TYPE_CHECKING:
    from services.bus.connection import Bus

logger = logging.getLogger(__name__)

# Reply header that carries a handler failure instead of a reply message.
ERROR_HEADER = "Epd-Error"
_MAX_ERROR_CHARS = 500


@dataclass
class Incoming:
    """One message delivered to a handler."""

    subject: str
    data: bytes
    # Reply subject; empty when the sender does not wait for an answer.
    reply: str
    headers: dict[str, str]
    _bus: Bus = field(repr=False)
    responded: bool = False

    def decode(self, msg_type: type[M]) -> M:
        """Parse the payload; MessageDecodeError when malformed."""
        return decode(self.data, msg_type)

    async def respond(self, msg: Message | bytes) -> None:
        """Answer the sender (no-op, logged, when it expects no answer)."""
        if not self.reply:
            logger.debug("no reply subject on %s; response dropped", self.subject)
            return
        await self._bus.publish(self.reply, msg)
        self.responded = True

    async def respond_error(self, message: str) -> None:
        """Answer with an error header; the requester raises RemoteError."""
        if not self.reply:
            return
        text = message[:_MAX_ERROR_CHARS].replace("\r", " ").replace("\n", " ")
        await self._bus.publish(self.reply, b"", headers={ERROR_HEADER: text})
        self.responded = True


Handler = Callable[[Incoming], Awaitable[None]]


class HandlerRunner:
    """Runs a handler safely for nats-py, optionally with bounded concurrency."""

    def __init__(self, bus: Bus, subject: str, handler: Handler, max_concurrency: int) -> None:
        """Wrap ``handler`` for ``subject``; ``max_concurrency`` >= 1."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._bus = bus
        self._subject = subject
        self._handler = handler
        self._max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(self, msg: Msg) -> None:
        """nats-py callback: one call per message, one at a time per subscription."""
        incoming = Incoming(
            subject=msg.subject,
            data=msg.data,
            reply=msg.reply,
            headers=dict(msg.headers or {}),
            _bus=self._bus,
        )
        if self._max_concurrency == 1:
            await self._run(incoming)
            return
        # Waiting for a slot here keeps further messages in the pending buffer.
        await self._slots.acquire()
        task = asyncio.create_task(self._run_in_slot(incoming))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_idle(self) -> None:
        """Wait until no handler call is running (callers bound this with a timeout)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _run_in_slot(self, incoming: Incoming) -> None:
        try:
            await self._run(incoming)
        finally:
            self._slots.release()

    async def _run(self, incoming: Incoming) -> None:
        try:
            await self._handler(incoming)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception(
                "bus handler failed subject=%s",
                incoming.subject,
                extra={"subject": incoming.subject},
            )
            if incoming.reply and not incoming.responded:
                await self._reply_failure(incoming, exc)

    async def _reply_failure(self, incoming: Incoming, exc: Exception) -> None:
        try:
            await incoming.respond_error(f"{type(exc).__name__}: {exc}")
        except Exception as reply_exc:  # the connection may be gone; never raise here
            logger.warning("cannot send error reply on %s: %r", incoming.subject, reply_exc)
