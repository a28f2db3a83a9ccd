"""Chunked transfer of payloads larger than the server's max_payload (sender side).

Protocol on one subject (``epd.kv.<instance-id>`` for KV blocks):

1. The sender publishes ``ChunkFrame{header}`` and, without waiting, the first
   ``INITIAL_CREDIT`` chunks, so a payload of that many chunks costs one round trip.
   The receiver answers the header with ``ChunkAck{acked_seq=-1, credit=N}`` or an
   error (refused, too large...); every receiver accepts the initial chunks.
2. The sender publishes the further ``ChunkFrame{chunk}`` messages in order, never
   beyond ``acked_seq + credit`` of the latest ack, so a slow receiver throttles the
   sender instead of being cut off as a slow consumer.
3. The receiver acknowledges cumulatively, at least once per ``credit`` chunks; the last
   ack carries ``complete=True`` once the total size and sequence are verified.

Replies go to one long-lived wildcard inbox per Bus, routed by a per-transfer token
(chunk_inbox.py). A "no responders" status on the header's subject means nothing was
delivered, so the sender retries for ``BusConfig.no_responders_grace_s``, like
Bus.request. A duplicate transfer id is refused, and the chunks that followed it make the
transfer already using that id fail.

Both sides time out when the other stops making progress. The receiver side lives in
chunk_receiver.py, the frames' wire format in chunk_wire.py. ``PayloadSender`` /
``PayloadReceiver`` are the contract a faster transport (RDMA, shared memory) can
implement later behind the KV connector.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from protos.epd_pb import bus_pb2
from services.bus.chunk_inbox import AckInbox, Acks
from services.bus.chunk_wire import (
    HEADROOM_BYTES,
    INITIAL_CREDIT,
    MAX_TRANSFER_ID_CHARS,
    chunk_frame,
    chunk_size_for,
    field_bytes,
    opening_header,
)
from services.bus.connection import ERROR_HEADER, Bus
from services.bus.errors import NoResponders, TransferError
from services.bus.messages import MessageDecodeError, decode

__all__ = [
    "HEADROOM_BYTES",
    "INITIAL_CREDIT",
    "MAX_TRANSFER_ID_CHARS",
    "NatsChunkSender",
    "PayloadReceiver",
    "PayloadSender",
    "ReceivedTransfer",
    "TransferStats",
    "chunk_size_for",
    "send_chunked",
]

logger = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


@dataclass(frozen=True)
class TransferStats:
    """What one send_chunked call did."""

    transfer_id: str
    total_bytes: int
    chunk_count: int
    chunk_bytes: int
    # Most chunks ever sent but not yet acknowledged.
    max_in_flight: int
    elapsed_s: float


@dataclass
class ReceivedTransfer:
    """A completed, verified transfer."""

    transfer_id: str
    header: bytes
    payload: bytearray


class PayloadSender(Protocol):
    """Sends one payload with an application header to a receiver."""

    async def send(
        self, header: bytes, payload: bytes | memoryview, *, transfer_id: str, timeout_s: float
    ) -> TransferStats: ...


class PayloadReceiver(Protocol):
    """Hands out completed transfers by id."""

    async def receive(self, transfer_id: str, timeout_s: float) -> ReceivedTransfer: ...


class NatsChunkSender:
    """PayloadSender over the bus, bound to one receiver subject."""

    def __init__(self, bus: Bus, subject: str, chunk_bytes: int | None = None) -> None:
        """Send to the ChunkReceiver listening on ``subject``."""
        self._bus = bus
        self._subject = subject
        self._chunk_bytes = chunk_bytes

    async def send(
        self, header: bytes, payload: bytes | memoryview, *, transfer_id: str, timeout_s: float
    ) -> TransferStats:
        """See send_chunked."""
        return await send_chunked(
            self._bus,
            self._subject,
            header,
            payload,
            timeout_s=timeout_s,
            transfer_id=transfer_id,
            chunk_bytes=self._chunk_bytes,
        )


async def send_chunked(
    bus: Bus,
    subject: str,
    header: bytes,
    payload: bytes | bytearray | memoryview,
    *,
    timeout_s: float,
    transfer_id: str | None = None,
    chunk_bytes: int | None = None,
) -> TransferStats:
    """Send ``payload`` in chunks to the ChunkReceiver on ``subject``; wait for completion.

    ``timeout_s`` bounds each wait for the receiver (the opening reply and every ack),
    so a transfer that keeps progressing never times out. Raises NoResponders (no
    receiver), TransferTimeout, TransferError (refused or failed on the receiver).
    """
    tid = transfer_id or uuid.uuid4().hex
    data = memoryview(payload).cast("B")
    opening = opening_header(tid, header, len(data), bus.max_payload, chunk_bytes)
    started = time.monotonic()
    inbox = await AckInbox.of(bus)
    grace_s = bus.config.no_responders_grace_s
    retry_until, delay = started + min(grace_s, timeout_s), 0.005
    while True:
        try:
            max_in_flight = await _Outgoing(bus, subject, opening, data, inbox).run(timeout_s)
            break
        except _HeaderNotDelivered:
            if time.monotonic() + delay > retry_until:
                raise NoResponders(subject) from None
            await asyncio.sleep(delay)
            delay *= 2
    elapsed = time.monotonic() - started
    stats = TransferStats(
        tid, len(data), opening.chunk_count, opening.chunk_bytes, max_in_flight, elapsed
    )
    logger.debug("chunked transfer sent %s", stats)
    return stats


class _HeaderNotDelivered(Exception):
    """The server had no subscriber for the header: nothing of this attempt arrived."""


class _Outgoing:
    """One attempt at a transfer: the header, then chunks within the receiver's credit."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        opening: bus_pb2.ChunkHeader,
        data: memoryview,
        inbox: AckInbox,
    ) -> None:
        self._bus, self._subject, self._opening = bus, subject, opening
        self._data, self._inbox = data, inbox
        self._tid = opening.transfer_id
        self._tid_field = field_bytes(1, self._tid.encode())

    async def run(self, timeout_s: float) -> int:
        """Send every chunk; return the largest number in flight at once."""
        header_reply, chunk_reply, acks = self._inbox.open()
        count, size = self._opening.chunk_count, self._opening.chunk_bytes
        next_seq, acked, credit, max_in_flight = 0, -1, INITIAL_CREDIT, 0
        try:
            frame = bus_pb2.ChunkFrame(header=self._opening)
            await self._bus.publish(self._subject, frame, reply=header_reply)
            while True:
                while next_seq < count and next_seq <= acked + credit:
                    piece = self._data[next_seq * size : (next_seq + 1) * size]
                    frame_bytes = chunk_frame(self._tid_field, next_seq, piece)
                    await self._bus.publish(self._subject, frame_bytes, reply=chunk_reply)
                    next_seq += 1
                    max_in_flight = max(max_in_flight, next_seq - 1 - acked)
                ack = await self._next_ack(acks, timeout_s)
                acked, credit = max(acked, ack.acked_seq), ack.credit
                if ack.complete:
                    break
        finally:
            self._inbox.close(header_reply)
        if acked != count - 1:
            raise TransferError(f"transfer {self._tid}: receiver completed at seq {acked}")
        return max_in_flight

    async def _next_ack(self, acks: Acks, timeout_s: float) -> bus_pb2.ChunkAck:
        while True:
            msg = await acks.get(timeout_s, f"transfer {self._tid} ack")
            headers = msg.headers or {}
            if headers.get("Status") == _NO_RESPONDERS:
                if msg.subject.rpartition(".")[2].startswith("h"):
                    raise _HeaderNotDelivered
                raise NoResponders(self._subject)
            if ERROR_HEADER in headers:
                raise TransferError(f"transfer {self._tid}: {headers[ERROR_HEADER]}")
            try:
                ack = decode(msg.data, bus_pb2.ChunkAck)
            except MessageDecodeError as exc:
                logger.warning("transfer %s: dropping malformed ack: %s", self._tid, exc)
                continue
            _check_ack(ack, self._tid)
            return ack


def _check_ack(ack: bus_pb2.ChunkAck, tid: str) -> None:
    if ack.HasField("error"):
        raise TransferError(f"transfer {tid} failed on the receiver: {ack.error.message}")
    if ack.transfer_id != tid:
        raise TransferError(f"transfer {tid}: ack for {ack.transfer_id!r}")
    if ack.credit < 1 and not ack.complete:
        raise TransferError(f"transfer {tid}: receiver granted no credit")
