"""Chunk frames are encoded and read by hand on the hot path: the bytes must be exactly
what the generated protobuf code writes, and reading must agree with protobuf on every
frame, falling back to it for any other layout."""

from __future__ import annotations

import os

import pytest

from protos.epd_pb import bus_pb2
from services.bus.chunk_wire import canonical_chunk as _canonical_chunk
from services.bus.chunk_wire import chunk_frame
from services.bus.chunk_wire import field_bytes as _field_bytes
from services.bus.chunk_wire import opening_header as _opening
from services.bus.chunk_wire import read_frame as _read_frame


def _generated(tid: str, seq: int, data: bytes) -> bytes:
    chunk = bus_pb2.Chunk(transfer_id=tid, seq=seq, data=data)
    return bus_pb2.ChunkFrame(chunk=chunk).SerializeToString()


@pytest.mark.parametrize(
    ("tid", "seq", "size"),
    [("t", 0, 1), ("x" * 128, 1, 127), ("é-ü", 127, 128), ("k", 300, 70_000), ("z", 2**31 - 1, 3)],
)
def test_hand_encoded_frame_is_byte_identical_and_reads_back(tid: str, seq: int, size: int) -> None:
    data = os.urandom(size)
    frame = chunk_frame(_field_bytes(1, tid.encode()), seq, memoryview(data))
    assert frame == _generated(tid, seq, data)
    piece = _canonical_chunk(frame)
    assert piece is not None and (piece.transfer_id, piece.seq) == (tid, seq)
    assert isinstance(piece.data, memoryview) and piece.data == data  # no copy


def test_other_layouts_fall_back_to_protobuf() -> None:
    # Same fields in another order, plus an explicit seq 0: valid protobuf, not canonical.
    reordered = b"\x12\x0a" + b"\x1a\x03abc" + b"\x0a\x01t" + b"\x10\x00"
    assert _canonical_chunk(reordered) is None
    assert tuple(_read_frame(reordered)) == ("t", 0, b"abc")
    header = bus_pb2.ChunkHeader(transfer_id="h", total_bytes=5, chunk_count=1, chunk_bytes=5)
    assert _read_frame(bus_pb2.ChunkFrame(header=header).SerializeToString()) == header


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x12", b"\x12\x05\x0a\x01t\x1a\x09abc", b"\x12\x06\x0a\x02\xff\xfe\x1a\x00"],
)
def test_truncated_or_invalid_frames_are_rejected(frame: bytes) -> None:
    assert _canonical_chunk(frame) is None
    with pytest.raises(ValueError):
        _read_frame(frame)


def test_chunks_are_equal_sized() -> None:
    # 1 MiB under a 1 MiB max_payload needs two chunks: two halves, not a full one and
    # a sliver; an explicit chunk size is kept.
    opening = _opening("t", b"", 1 << 20, 1 << 20, None)
    assert (opening.chunk_count, opening.chunk_bytes) == (2, 1 << 19)
    assert _opening("t", b"", 1 << 20, 1 << 20, 1000).chunk_bytes == 1000
