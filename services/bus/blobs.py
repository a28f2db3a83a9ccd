"""The one path for payloads too large for a bus message (images, embeddings).

A message whose payload does not fit (``fits_inline``) sends the payload ahead as a
chunked, flow-controlled transfer (chunked.py) to the receiving instance's blob subject
``epd.blob.<id>`` and carries a ``BlobRef`` instead; the receiver takes it from its
``BlobInbox`` by transfer id. KV blocks take the same chunked path on their own subject
(kv_connector.py). So everything works with NATS at its default 1 MiB ``max_payload``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.chunk_receiver import ChunkReceiver
from services.bus.chunked import send_chunked
from services.bus.connection import Bus
from services.bus.errors import TransferError

# Room left in a message for everything but its inline payload (ids, hashes, params).
INLINE_HEADROOM_BYTES = 64 << 10


def fits_inline(bus: Bus, nbytes: int) -> bool:
    """Whether a payload of ``nbytes`` may travel inside a message (the limit, set once)."""
    return nbytes + INLINE_HEADROOM_BYTES <= bus.max_payload


async def send_blob(
    bus: Bus,
    instance_id: str,
    data: bytes | bytearray | memoryview,
    timeout_s: float,
    transfer_id: str | None = None,
) -> bus_pb2.BlobRef:
    """Send ``data`` to ``instance_id``'s blob inbox; the reference a message carries.

    Raises NoResponders (no such instance), TransferTimeout, TransferError.
    """
    tid = transfer_id or f"blob-{uuid.uuid4().hex}"
    view = memoryview(data).cast("B")
    await send_chunked(
        bus, subjects.blob(instance_id), b"", view, timeout_s=timeout_s, transfer_id=tid
    )
    return bus_pb2.BlobRef(transfer_id=tid, size=len(view))


class BlobInbox:
    """Receives blobs sent to this instance; hands each out by its reference.

    A blob may be asked for more than once (the choices of an n > 1 request refer to the
    same embedding), so taken blobs stay for ``keep_s`` (at most ``keep_max`` of them).
    """

    def __init__(
        self, bus: Bus, instance_id: str, max_bytes: int, keep_s: float = 30.0, keep_max: int = 64
    ):
        self._chunks = ChunkReceiver(bus, subjects.blob(instance_id), max_total_bytes=max_bytes)
        self._keep_s, self._keep_max = keep_s, keep_max
        self._taken: OrderedDict[str, tuple[float, bytearray]] = OrderedDict()
        # Blobs received so far (tests check that a cached image is not sent again).
        self.received = 0

    async def start(self) -> None:
        await self._chunks.start()

    async def close(self) -> None:
        await self._chunks.close()
        self._taken.clear()

    async def take(self, ref: bus_pb2.BlobRef, timeout_s: float) -> bytearray:
        """The blob's bytes (TransferTimeout, TransferError; a size that differs from the
        reference is a TransferError)."""
        now = time.monotonic()
        while self._taken and next(iter(self._taken.values()))[0] < now:
            self._taken.popitem(last=False)
        kept = self._taken.get(ref.transfer_id)
        if kept is not None:
            return kept[1]
        got = await self._chunks.receive(ref.transfer_id, timeout_s)
        if len(got.payload) != ref.size:
            raise TransferError(
                f"blob {ref.transfer_id}: {len(got.payload)} bytes, the reference says {ref.size}"
            )
        self.received += 1
        self._taken[ref.transfer_id] = (now + self._keep_s, got.payload)
        while len(self._taken) > self._keep_max:
            self._taken.popitem(last=False)
        return got.payload
