"""Receiving side of chunked transfers (protocol in chunked.py, frames in chunk_wire.py).

One ChunkReceiver subscribes once to its subject and reassembles any number of
concurrent transfers, keyed by transfer id. A consumer claims a finished transfer with
``await receiver.receive(transfer_id, timeout_s)``; it may call before or after the
transfer completes. Transfers that stall are dropped after ``idle_timeout_s``; finished
ones nobody claims are dropped after ``unclaimed_ttl_s`` (both checked by one periodic
sweep, a quarter of the shorter limit apart, that holds no payload). Chunks are acknowledged
cumulatively, every ``window // 2`` of them (and the last), which keeps the sender's
credit open without an ack per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

from nats.aio.subscription import Subscription

from protos.epd_pb import bus_pb2
from services.bus.chunk_wire import INITIAL_CREDIT, Piece, read_frame
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
    # Grown chunk by chunk: a bytearray(total_bytes) would first zero-fill every page.
    buffer: bytearray = field(default_factory=bytearray)
    next_seq: int = 0
    # loop.time() of the last frame; the sweep fails the transfer idle_timeout_s later.
    active_at: float = 0.0


@dataclass(frozen=True)
class _HeldAck:
    """An opening ack not sent yet, and where it goes."""

    transfer_id: str
    reply: str
    ack: bus_pb2.ChunkAck


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
        """``window``: chunks a sender may have unacknowledged (at least INITIAL_CREDIT
        before the opening ack); bounds buffered bytes to about window * max_payload
        per concurrent transfer."""
        if window < 1 or max_transfers < 1 or idle_timeout_s <= 0 or unclaimed_ttl_s <= 0:
            raise ValueError("window, max_transfers and timeouts must be positive")
        self._bus, self._subject = bus, subject
        self._window, self._max_total = window, max_total_bytes
        self._ack_every = max(1, window // 2)
        self._max_transfers = max_transfers
        self._idle_s, self._ttl_s = idle_timeout_s, unclaimed_ttl_s
        self._active: dict[str, _Transfer] = {}
        self._results: dict[str, asyncio.Future[ReceivedTransfer]] = {}
        # Expiry (loop time) of finished results nobody claimed yet, oldest first.
        self._unclaimed: dict[str, float] = {}
        self._sweep_s = min(idle_timeout_s, unclaimed_ttl_s) / 4
        self._sweeper: asyncio.TimerHandle | None = None
        self._sub: Subscription | None = None
        # The last header's credit ack, held back while the frame behind it is handled.
        self._held: _HeldAck | None = None

    @property
    def active_transfers(self) -> int:
        """Transfers being received now."""
        return len(self._active)

    async def start(self) -> None:
        """Subscribe; senders get NoResponders until this is done."""
        frames = max(self._window, INITIAL_CREDIT) + 2
        pending = frames * self._bus.max_payload * self._max_transfers
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
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def receive(self, transfer_id: str, timeout_s: float) -> ReceivedTransfer:
        """Wait for ``transfer_id`` to complete and claim it (TransferTimeout, TransferError)."""
        if self._sub is None:
            raise BusUnavailable("chunk receiver is not started")
        fut = self._future(transfer_id)
        # asyncio.wait, not wait_for: a transfer that failed with TransferTimeout (a
        # TimeoutError) must not be mistaken for this wait timing out.
        if not fut.done() and not (await asyncio.wait({fut}, timeout=timeout_s))[0]:
            if transfer_id not in self._active:
                self._results.pop(transfer_id, None)
            raise TransferTimeout(f"transfer {transfer_id}", timeout_s)
        self._results.pop(transfer_id, None)
        self._unclaimed.pop(transfer_id, None)
        return fut.result()

    def refuse(self, transfer_id: str, reason: str) -> None:
        """Drop ``transfer_id`` (what arrived, and whatever comes later): its sender's
        next frame is answered with an error and it stops."""
        fut = self._results.get(transfer_id)
        if fut is not None and fut.done():
            del self._results[transfer_id]  # complete already: drop the payload
        self._fail(transfer_id, TransferError(f"transfer {transfer_id} refused: {reason}"))

    async def _on_frame(self, msg: Incoming) -> None:
        held, self._held = self._held, None
        try:
            frame = read_frame(msg.data)
            if isinstance(frame, Piece):
                owed = held is not None and held.transfer_id == frame.transfer_id
                ack = self._store(frame, force_ack=owed)
                held = None if owed else held
            else:
                ack = self._open(frame)
                if ack.credit and self._sub is not None and self._sub.pending_msgs:
                    # Frames are queued behind the header, most likely its first chunk,
                    # whose ack will grant the same credit: one message less per transfer.
                    self._held, ack = _HeldAck(ack.transfer_id, msg.reply, ack), None
            if ack is not None:
                await msg.respond(ack)
        finally:
            if held is not None:  # the next frame was not that chunk: a sender may wait
                await self._bus.publish(held.reply, held.ack)

    def _open(self, opening: bus_pb2.ChunkHeader) -> bus_pb2.ChunkAck:
        tid = opening.transfer_id
        problem = self._check_opening(opening)
        if problem is not None:
            logger.warning("transfer %s refused: %s", tid, problem[1])
            return _error_ack(tid, *problem)
        loop = asyncio.get_running_loop()
        self._active[tid] = _Transfer(opening, active_at=loop.time())
        self._future(tid)
        if opening.chunk_count == 0:
            self._complete(tid)
            return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=-1, complete=True)
        self._arm_sweeper()
        return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=-1, credit=self._window)

    def _check_opening(self, h: bus_pb2.ChunkHeader) -> tuple[int, str] | None:
        claimable = self._results.get(h.transfer_id)
        if not h.transfer_id or h.transfer_id in self._active or (claimable and claimable.done()):
            return _INVALID, "missing or duplicate transfer id"
        if len(self._active) >= self._max_transfers:
            return _REFUSED, f"{len(self._active)} transfers already in progress"
        if not 0 <= h.total_bytes <= self._max_total:
            return _REFUSED, f"total_bytes {h.total_bytes} outside [0, {self._max_total}]"
        if h.chunk_bytes <= 0 or h.chunk_count != math.ceil(h.total_bytes / h.chunk_bytes):
            return _INVALID, f"{h.chunk_count} chunks of {h.chunk_bytes} bytes != {h.total_bytes}"
        return None

    def _store(self, chunk: Piece, force_ack: bool) -> bus_pb2.ChunkAck | None:
        """Append one chunk; the ack to send now, or None (acks are cumulative)."""
        tid, seq, data = chunk
        state = self._active.get(tid)
        if state is None:
            return _error_ack(tid, _INVALID, "unknown or expired transfer")
        o = state.opening
        expected = min(o.chunk_bytes, o.total_bytes - seq * o.chunk_bytes)
        if seq != state.next_seq or len(data) != expected:
            error = f"got chunk {seq} of {len(data)} bytes, expected {state.next_seq}"
            self._fail(tid, TransferError(f"transfer {tid}: {error}"))
            return _error_ack(tid, _INVALID, error)
        state.buffer += data
        state.next_seq += 1
        if state.next_seq == o.chunk_count:
            self._complete(tid)
            return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=seq, complete=True)
        state.active_at = asyncio.get_running_loop().time()
        if state.next_seq % self._ack_every and not force_ack:
            return None
        return bus_pb2.ChunkAck(transfer_id=tid, acked_seq=seq, credit=self._window)

    def _future(self, tid: str) -> asyncio.Future[ReceivedTransfer]:
        fut = self._results.get(tid)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._results[tid] = fut
        return fut

    def _complete(self, tid: str) -> None:
        state = self._active.pop(tid)
        fut = self._future(tid)
        if not fut.done():
            fut.set_result(ReceivedTransfer(tid, state.opening.header, state.buffer))
        self._keep_unclaimed(tid)

    def _fail(self, tid: str, error: Exception) -> None:
        self._active.pop(tid, None)
        logger.warning("transfer %s dropped: %s", tid, error)
        fut = self._future(tid)
        if not fut.done():
            fut.set_exception(error)
            fut.exception()  # retrieved: nobody may be waiting for it
        self._keep_unclaimed(tid)

    def _keep_unclaimed(self, tid: str) -> None:
        self._unclaimed[tid] = asyncio.get_running_loop().time() + self._ttl_s
        self._arm_sweeper()

    def _arm_sweeper(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self._sweep_s, self._sweep)

    def _sweep(self) -> None:
        """Fail stalled transfers; drop results unclaimed for unclaimed_ttl_s."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for tid in [t for t, s in self._active.items() if now - s.active_at >= self._idle_s]:
            self._fail(tid, TransferTimeout(f"transfer {tid} idle", self._idle_s))
        for tid, due in list(self._unclaimed.items()):
            if due > now:
                break  # insertion order is expiry order: the ttl is the same for all
            del self._unclaimed[tid]
            if self._results.pop(tid, None) is not None:
                logger.info("transfer %s was never claimed; dropped", tid)
        if self._active or self._unclaimed:
            self._arm_sweeper()


def _error_ack(tid: str, code: int, message: str) -> bus_pb2.ChunkAck:
    return bus_pb2.ChunkAck(transfer_id=tid, error=bus_pb2.Error(code=code, message=message))
