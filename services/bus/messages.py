"""Protobuf message encoding for the bus (torch-free; see codec.py for tensors)."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


class MessageDecodeError(ValueError):
    """Bytes received from the bus do not parse as the expected message type."""


def encode(msg: Message | bytes) -> bytes:
    """Serialize a protobuf message (bytes pass through unchanged)."""
    if isinstance(msg, bytes | bytearray | memoryview):
        return bytes(msg)
    if not isinstance(msg, Message):
        raise TypeError(f"expected a protobuf message or bytes, got {type(msg).__name__}")
    return msg.SerializeToString()


def decode(data: bytes | bytearray | memoryview, msg_type: type[M]) -> M:
    """Parse ``data`` as ``msg_type``; raise MessageDecodeError when it is malformed."""
    msg = msg_type()
    try:
        msg.ParseFromString(bytes(data))
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise MessageDecodeError(
            f"cannot decode {len(data)} bytes as {msg_type.DESCRIPTOR.full_name}: {exc}"
        ) from exc
    return msg
