"""Wire format of chunked transfers (protocol in chunked.py): frame sizing and the
hand-written encoding and reading of ``ChunkFrame{chunk}``.

Chunk frames are the hot path: building and parsing them through the generated protobuf
code copies the data several times, so they are written and read by hand, byte for byte
what the generated code writes. Any other layout falls back to protobuf.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from protos.epd_pb import bus_pb2
from services.bus.messages import decode

# Bytes of each message kept free for the frame's protobuf fields (at most ~150).
HEADROOM_BYTES = 256
MAX_TRANSFER_ID_CHARS = 128
# Chunks sent right behind the header, before any ack; every receiver accepts them.
INITIAL_CREDIT = 2


class Piece(NamedTuple):
    """One received chunk."""

    transfer_id: str
    seq: int
    data: bytes | memoryview


def chunk_size_for(max_payload: int, requested: int | None = None) -> int:
    """Chunk size that fits under ``max_payload`` with headroom (``requested`` caps it)."""
    limit = max_payload - HEADROOM_BYTES
    if limit <= 0:
        raise ValueError(f"max_payload {max_payload} leaves no room for chunk data")
    if requested is not None and requested <= 0:
        raise ValueError(f"chunk size must be > 0, got {requested}")
    return limit if requested is None else min(limit, requested)


def opening_header(
    tid: str, header: bytes, total: int, max_payload: int, chunk_bytes: int | None
) -> bus_pb2.ChunkHeader:
    """The validated opening frame of a transfer."""
    if not tid or len(tid) > MAX_TRANSFER_ID_CHARS:
        raise ValueError(f"transfer id must have 1..{MAX_TRANSFER_ID_CHARS} characters")
    if len(header) + HEADROOM_BYTES > max_payload:
        raise ValueError(f"transfer header of {len(header)} bytes exceeds max_payload")
    size = chunk_size_for(max_payload, chunk_bytes)
    count = math.ceil(total / size)
    if chunk_bytes is None and count > 1:
        size = math.ceil(total / count)  # equal chunks, not a full one and a sliver
    return bus_pb2.ChunkHeader(
        transfer_id=tid, header=header, total_bytes=total, chunk_count=count, chunk_bytes=size
    )


def chunk_frame(tid_field: bytes, seq: int, data: memoryview) -> bytes:
    """``ChunkFrame{chunk: Chunk{transfer_id, seq, data}}`` in protobuf wire format,
    byte for byte what the generated code writes; ``tid_field`` is field 1 encoded.

    Written by hand because building and serializing the message costs ~3 ms per MiB
    (several copies); this copies ``data`` once.
    """
    seq_field = b"\x10" + _varint(seq) if seq else b""
    head = tid_field + seq_field + b"\x1a" + _varint(len(data))
    return b"".join((b"\x12", _varint(len(head) + len(data)), head, data))


def field_bytes(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: tag, length, ``value``."""
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def read_frame(data: bytes) -> bus_pb2.ChunkHeader | Piece:
    """Parse a ChunkFrame (MessageDecodeError, ValueError when it is not one)."""
    piece = canonical_chunk(data)
    if piece is not None:
        return piece
    frame = decode(data, bus_pb2.ChunkFrame)
    kind = frame.WhichOneof("frame")
    if kind == "header":
        return frame.header
    if kind == "chunk":
        return Piece(frame.chunk.transfer_id, frame.chunk.seq, frame.chunk.data)
    raise ValueError("empty chunk frame")


def canonical_chunk(data: bytes) -> Piece | None:
    """A chunk frame laid out exactly as chunk_frame writes it, read without copying
    its data (protobuf would copy it twice); None for any other layout."""
    try:
        size, pos = _varint_at(data, 1)
        if data[0] != 0x12 or pos + size != len(data) or data[pos] != 0x0A:
            return None
        size, pos = _varint_at(data, pos + 1)
        tid, pos, seq = data[pos : pos + size].decode(), pos + size, 0
        if data[pos] == 0x10:
            seq, pos = _varint_at(data, pos + 1)
        if data[pos] != 0x1A or seq >= 1 << 31:
            return None
        size, pos = _varint_at(data, pos + 1)
    except (IndexError, UnicodeDecodeError):
        return None
    return Piece(tid, seq, memoryview(data)[pos:]) if pos + size == len(data) else None


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    """The varint starting at ``pos`` and the position after it (IndexError if cut)."""
    value = shift = 0
    while shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    raise IndexError("varint longer than 10 bytes")
