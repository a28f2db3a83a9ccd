"""Chunked transfer of payloads larger than the server's max_payload (sender side).

Protocol on one subject (``epd.kv.<instance-id>`` for KV blocks):

1. The sender requests with a ``ChunkFrame{header}``; the receiver answers a
   ``ChunkAck{acked_seq=-1, credit=N}`` (or an error: refused, too large...).
2. The sender publishes ``ChunkFrame{chunk}`` messages in order, with its private inbox
   as reply subject, never more than ``credit`` beyond the last acknowledged one, so a
   slow receiver throttles the sender instead of being cut off as a slow consumer.
3. The receiver acknowledges every chunk; the last ack carries ``complete=True`` once
   the total size and sequence are verified.

Both sides time out when the other stops making progress. The receiver side lives in
chunk_receiver.py. ``PayloadSender`` / ``PayloadReceiver`` are the contract a faster
transport (RDMA, shared memory) can implement later behind the KV connector.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from nats.aio.msg import Msg

from protos.epd_pb import bus_pb2
from services.bus.connection import Bus
from services.bus.errors import TransferError, TransferTimeout
from services.bus.messages import MessageDecodeError, decode

logger = logging.getLogger(__name__)

# Bytes of each message kept free for the frame's protobuf fields and the NATS protocol.
HEADROOM_BYTES = 1024
MAX_TRANSFER_ID_CHARS = 128


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


def chunk_size_for(max_payload: int, requested: int | None = None) -> int:
    """Chunk size that fits under ``max_payload`` with headroom (``requested`` caps it)."""
    limit = max_payload - HEADROOM_BYTES
    if limit <= 0:
        raise ValueError(f"max_payload {max_payload} leaves no room for chunk data")
    if requested is not None and requested <= 0:
        raise ValueError(f"chunk size must be > 0, got {requested}")
    return limit if requested is None else min(limit, requested)


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
    opening = _opening(tid, header, len(data), bus.max_payload, chunk_bytes)
    size, count = opening.chunk_bytes, opening.chunk_count
    started = time.monotonic()
    inbox = bus.new_inbox()
    sub, acks = await bus.subscribe_queue(inbox)
    try:
        first = await bus.request(
            subject, bus_pb2.ChunkFrame(header=opening), bus_pb2.ChunkAck, timeout_s
        )
        _check_ack(first, tid)
        stream = _ChunkStream(bus, subject, inbox, tid, data, size, count)
        max_in_flight = await stream.run(first, acks, timeout_s)
    finally:
        await sub.unsubscribe()
    stats = TransferStats(tid, len(data), count, size, max_in_flight, time.monotonic() - started)
    logger.debug("chunked transfer sent %s", stats)
    return stats


def _opening(
    tid: str, header: bytes, total: int, max_payload: int, chunk_bytes: int | None
) -> bus_pb2.ChunkHeader:
    """The validated opening frame of a transfer."""
    if not tid or len(tid) > MAX_TRANSFER_ID_CHARS:
        raise ValueError(f"transfer id must have 1..{MAX_TRANSFER_ID_CHARS} characters")
    if len(header) + HEADROOM_BYTES > max_payload:
        raise ValueError(f"transfer header of {len(header)} bytes exceeds max_payload")
    size = chunk_size_for(max_payload, chunk_bytes)
    return bus_pb2.ChunkHeader(
        transfer_id=tid,
        header=header,
        total_bytes=total,
        chunk_count=math.ceil(total / size),
        chunk_bytes=size,
    )


class _ChunkStream:
    """Sends the chunks of one transfer within the receiver's credit."""

    def __init__(
        self, bus: Bus, subject: str, inbox: str, tid: str, data: memoryview, size: int, count: int
    ) -> None:
        self._bus, self._subject, self._inbox = bus, subject, inbox
        self._tid, self._data, self._size, self._count = tid, data, size, count

    async def run(self, ack: bus_pb2.ChunkAck, acks: asyncio.Queue[Msg], timeout_s: float) -> int:
        """Send every chunk; return the largest number in flight at once."""
        next_seq, acked, max_in_flight = 0, ack.acked_seq, 0
        while not ack.complete:
            while next_seq < self._count and next_seq <= acked + ack.credit:
                await self._send(next_seq)
                next_seq += 1
                max_in_flight = max(max_in_flight, next_seq - 1 - acked)
            ack = await self._next_ack(acks, timeout_s)
            acked = max(acked, ack.acked_seq)
        if acked != self._count - 1:
            raise TransferError(f"transfer {self._tid}: receiver completed at seq {acked}")
        return max_in_flight

    async def _send(self, seq: int) -> None:
        piece = bytes(self._data[seq * self._size : (seq + 1) * self._size])
        chunk = bus_pb2.Chunk(transfer_id=self._tid, seq=seq, data=piece)
        frame = bus_pb2.ChunkFrame(chunk=chunk)
        await self._bus.publish(self._subject, frame, reply=self._inbox)

    async def _next_ack(self, acks: asyncio.Queue[Msg], timeout_s: float) -> bus_pb2.ChunkAck:
        while True:
            try:
                msg = await asyncio.wait_for(acks.get(), timeout=timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"transfer {self._tid} ack", timeout_s) from None
            try:
                ack = decode(msg.data, bus_pb2.ChunkAck)
            except MessageDecodeError as exc:
                logger.warning("transfer %s: dropping malformed ack: %s", self._tid, exc)
                continue
            if ack.transfer_id == self._tid:
                _check_ack(ack, self._tid)
                return ack


def _check_ack(ack: bus_pb2.ChunkAck, tid: str) -> None:
    if ack.HasField("error"):
        raise TransferError(f"transfer {tid} failed on the receiver: {ack.error.message}")
    if ack.transfer_id != tid:
        raise TransferError(f"transfer {tid}: ack for {ack.transfer_id!r}")
    if ack.credit < 1 and not ack.complete:
        raise TransferError(f"transfer {tid}: receiver granted no credit")
