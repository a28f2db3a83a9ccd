"""Receiving side of chunked transfers (protocol in chunked.py).

One ChunkReceiver subscribes once to its subject and reassembles any number of
concurrent transfers, keyed by transfer id. A consumer claims a finished transfer with
``await receiver.receive(transfer_id, timeout_s)``; it may call before or after the
transfer completes. Transfers that stall are dropped after ``idle_timeout_s``; finished
ones nobody claims are dropped after ``unclaimed_ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from protos.epd_pb import bus_pb2
from services.bus.chunked import ReceivedTransfer
from services.bus.connection import Bus, Incoming
from services.bus.errors import BusUnavailable, TransferError, TransferTimeout

logger = logging.getLogger(__name__)

_REFUSED = bus_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
_INVALID = bus_pb2.ERROR_CODE_INVALID_ARGUMENT


@dataclass
class _Transfer:
    """Reassembly state of one transfer."""

    opening: bus_pb2.ChunkHeader
    buffer: bytearray
    next_seq: int = 0
    timer: asyncio.TimerHandle | None = None


class ChunkReceiver:
    """Reassembles chunked transfers sent to one subject (see send_chunked)."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        *,
        window: int = 8,
        max_total_bytes: int = 8 << 30,
        max_transfers: int = 64,
        idle_timeout_s: float = 10.0,
        unclaimed_ttl_s: float = 30.0,
    ) -> None:
        """``window``: chunks a sender may have unacknowledged; bounds buffered bytes
        to about window * max_payload per concurrent transfer."""
        if window < 1 or max_transfers < 1 or idle_timeout_s <= 0 or unclaimed_ttl_s <= 0:
            raise ValueError("window, max_transfers and timeouts must be positive")
        self._bus, self._subject = bus, subject
        self._window, self._max_total = window, max_total_bytes
        self._max_transfers = max_transfers
        self._idle_s, self._ttl_s = idle_timeout_s, unclaimed_ttl_s
        self._active: dict[str, _Transfer] = {}
        self._results: dict[str, asyncio.Future[ReceivedTransfer]] = {}
        self._sub: Subscription | None = None

    @property
    def active_transfers(self) -> int:
        """Transfers being received now."""
        return len(self._active)

    async def start(self) -> None:
        """Subscribe; senders get NoResponders until this is done."""
        pending = (self._window + 2) * self._bus.max_payload * self._max_transfers
        self._sub = await self._bus.subscribe(
            self._subject, self._on_frame, pending_bytes_limit=pending
        )

    async def close(self) -> None:
        """Unsubscribe and fail every transfer still in progress. Safe to call twice."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the bus may already be closed
                logger.debug("chunk receiver unsubscribe failed: %r", exc)
        for tid in list(self._active):
            self._fail(tid, TransferError(f"transfer {tid}: receiver closed"))

    async def receive(self, transfer_id: str, timeout_s: float) -> ReceivedTransfer:
        """Wait for ``transfer_id`` to complete and claim it (TransferTimeout, TransferError)."""
        if self._sub is None:
            raise BusUnavailable("chunk receiver is not started")
        fut = self._future(transfer_id)
        # asyncio.wait, not wait_for: a transfer that failed with TransferTimeout (a
        # TimeoutError) must not be mistaken for this wait timing out.
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)
        if not done:
            if transfer_id not in self._active:
                self._results.pop(transfer_id, None)
            raise TransferTimeout(f"transfer {transfer_id}", timeout_s)
        self._results.pop(transfer_id, None)
        return fut.result()

    async def _on_frame(self, msg: Incoming) -> None:
        frame = msg.decode(bus_pb2.ChunkFrame)
        kind = frame.WhichOneof("frame")
        if kind == "header":
            await msg.respond(self._open(frame.header))
        elif kind == "chunk":
            ack = self._store(frame.chunk)
            await msg.respond(ack)
        else:
            raise ValueError("empty chunk frame")

    def _open(self, opening: bus_pb2.ChunkHeader) -> bus_pb2.ChunkAck:
        tid = opening.transfer_id
        problem = self._check_opening(opening)
        if problem is not None:
            logger.warning("transfer %s refused: %s", tid, problem[1])
            return _error_ack(tid, *problem)
        self._active[tid] = _Transfer(opening, bytearray(opening.total_bytes))
        self._future(tid)
        if opening.chunk_count == 0:
            self._complete(tid)
            return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=-1, complete=True)
        self._touch(tid)
        return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=-1, credit=self._window)

    def _check_opening(self, h: bus_pb2.ChunkHeader) -> tuple[int, str] | None:
        if not h.transfer_id or h.transfer_id in self._active or h.transfer_id in self._done():
            return _INVALID, "missing or duplicate transfer id"
        if len(self._active) >= self._max_transfers:
            return _REFUSED, f"{len(self._active)} transfers already in progress"
        if not 0 <= h.total_bytes <= self._max_total:
            return _REFUSED, f"total_bytes {h.total_bytes} outside [0, {self._max_total}]"
        if h.chunk_bytes <= 0 or h.chunk_count != math.ceil(h.total_bytes / h.chunk_bytes):
            return _INVALID, f"{h.chunk_count} chunks of {h.chunk_bytes} bytes != {h.total_bytes}"
        return None

    def _store(self, chunk: bus_pb2.Chunk) -> bus_pb2.ChunkAck:
        tid = chunk.transfer_id
        state = self._active.get(tid)
        if state is None:
            return _error_ack(tid, _INVALID, "unknown or expired transfer")
        o = state.opening
        offset = chunk.seq * o.chunk_bytes
        expected = min(o.chunk_bytes, o.total_bytes - offset)
        if chunk.seq != state.next_seq or len(chunk.data) != expected:
            error = f"got chunk {chunk.seq} of {len(chunk.data)} bytes, expected {state.next_seq}"
            self._fail(tid, TransferError(f"transfer {tid}: {error}"))
            return _error_ack(tid, _INVALID, error)
        state.buffer[offset : offset + expected] = chunk.data
        state.next_seq += 1
        if state.next_seq == o.chunk_count:
            self._complete(tid)
            return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=chunk.seq, complete=True)
        self._touch(tid)
        return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=chunk.seq, credit=self._window)

    def _future(self, tid: str) -> asyncio.Future[ReceivedTransfer]:
        fut = self._results.get(tid)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._results[tid] = fut
        return fut

    def _done(self) -> set[str]:
        return {tid for tid, fut in self._results.items() if fut.done()}

    def _touch(self, tid: str) -> None:
        state = self._active[tid]
        if state.timer is not None:
            state.timer.cancel()
        loop = asyncio.get_running_loop()
        error = TransferTimeout(f"transfer {tid} idle", self._idle_s)
        state.timer = loop.call_later(self._idle_s, self._fail, tid, error)

    def _complete(self, tid: str) -> None:
        state = self._active.pop(tid)
        if state.timer is not None:
            state.timer.cancel()
        fut = self._future(tid)
        if not fut.done():
            fut.set_result(ReceivedTransfer(tid, state.opening.header, state.buffer))
        asyncio.get_running_loop().call_later(self._ttl_s, self._expire, tid, fut)

    def _fail(self, tid: str, error: Exception) -> None:
        state = self._active.pop(tid, None)
        if state is not None and state.timer is not None:
            state.timer.cancel()
        logger.warning("transfer %s dropped: %s", tid, error)
        fut = self._future(tid)
        if not fut.done():
            fut.set_exception(error)
            fut.exception()  # retrieved: nobody may be waiting for it
        asyncio.get_running_loop().call_later(self._ttl_s, self._expire, tid, fut)

    def _expire(self, tid: str, fut: asyncio.Future[ReceivedTransfer]) -> None:
        if self._results.get(tid) is fut:
            del self._results[tid]
            logger.info("transfer %s was never claimed; dropped", tid)


def _error_ack(tid: str, code: int, message: str) -> bus_pb2.ChunkAck:
    return bus_pb2.ChunkAck(transfer_id=tid, error=bus_pb2.Error(code=code, message=message))
