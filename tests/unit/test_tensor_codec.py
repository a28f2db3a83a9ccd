"""Tensors survive the wire bit-exactly, and malformed tensor messages are rejected."""

from __future__ import annotations

import pytest
import torch

from protos.epd_pb import bus_pb2
from services.bus.codec import (
    DTYPES,
    MessageDecodeError,
    decode,
    encode,
    tensor_from_bytes,
    tensor_from_proto,
    tensor_to_bytes,
    tensor_to_proto,
)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    tensor = (torch.randn(3, 4, 5) * 50).to(dtype)
    msg = bus_pb2.Tensor.FromString(tensor_to_proto(tensor).SerializeToString())
    back = tensor_from_proto(msg, expected_dtype=dtype, expected_shape=[3, None, 5])
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_bfloat16_bits_and_non_contiguous_input() -> None:
    tensor = torch.randn(6, 7).to(torch.bfloat16).t()  # non-contiguous view
    msg = tensor_to_proto(tensor)
    assert msg.dtype == "bfloat16" and list(msg.shape) == [7, 6]
    assert len(msg.data) == 7 * 6 * 2
    back = tensor_from_proto(msg)
    assert torch.equal(back.view(torch.int16), tensor.contiguous().view(torch.int16))


def test_raw_little_endian_bytes_no_pickle() -> None:
    msg = tensor_to_proto(torch.tensor([1, 256], dtype=torch.int32))
    assert msg.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_scalar_and_empty_tensors() -> None:
    assert torch.equal(tensor_from_proto(tensor_to_proto(torch.tensor(2.5))), torch.tensor(2.5))
    empty = tensor_from_proto(tensor_to_proto(torch.zeros(0, 4, dtype=torch.float16)))
    assert empty.shape == (0, 4) and empty.dtype == torch.float16


def test_decoded_tensor_owns_writable_memory() -> None:
    msg = tensor_to_proto(torch.arange(4, dtype=torch.float32))
    back = tensor_from_proto(msg)
    back += 1  # must not touch the message's immutable bytes
    assert torch.equal(tensor_from_proto(msg), torch.arange(4, dtype=torch.float32))


def test_take_ownership_shares_a_bytearray_and_the_default_copies() -> None:
    data = bytearray(tensor_to_bytes(torch.arange(4, dtype=torch.int32))[0])
    owned = tensor_from_bytes(data, "int32", [4], take_ownership=True)
    copied = tensor_from_bytes(data, "int32", [4])
    data[:4] = b"\x07\x00\x00\x00"  # the caller's buffer changes after decoding
    assert owned.tolist() == [7, 1, 2, 3]  # shares the bytearray's memory
    assert copied.tolist() == [0, 1, 2, 3]  # a private copy
    frozen = bytes(data)  # immutable: copied even when ownership is offered
    writable = tensor_from_bytes(frozen, "int32", [4], take_ownership=True)
    writable += 1
    assert frozen == bytes(data) and writable.tolist() == [8, 2, 3, 4]


def _msg(data: bytes, dtype: str, shape: list[int]) -> bus_pb2.Tensor:
    return bus_pb2.Tensor(data=data, dtype=dtype, shape=shape)


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (_msg(b"\x00" * 8, "float64", [1]), "unknown tensor dtype"),
        (_msg(b"\x00" * 8, "", [2]), "unknown tensor dtype"),
        (_msg(b"\x00" * 7, "float32", [2]), "7 bytes"),
        (_msg(b"\x00" * 12, "float32", [2]), "12 bytes"),
        (_msg(b"", "float32", [-1, 0]), "negative"),
        (_msg(b"", "uint8", [1] * 9), "at most 8"),
        (_msg(b"", "uint8", [0, 2**40]), "dimension above"),
        (_msg(b"\x00" * 4, "int32", []), None),  # a valid scalar, for contrast
    ],
)
def test_rejects_malformed_messages(msg: bus_pb2.Tensor, match: str | None) -> None:
    if match is None:
        assert tensor_from_proto(msg).shape == ()
        return
    with pytest.raises(ValueError, match=match):
        tensor_from_proto(msg)


def test_rejects_unexpected_dtype_or_shape() -> None:
    msg = tensor_to_proto(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="does not match the expected float16"):
        tensor_from_proto(msg, expected_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"\[2, 3\] does not match \[2, 4\]"):
        tensor_from_proto(msg, expected_shape=[2, 4])
    with pytest.raises(ValueError, match="does not match"):
        tensor_from_proto(msg, expected_shape=[None])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bool, torch.int16, torch.complex64])
def test_refuses_to_send_dtypes_outside_the_whitelist(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="not allowed on the wire"):
        tensor_to_proto(torch.zeros(2, dtype=dtype))


def test_message_helpers() -> None:
    hb = bus_pb2.Heartbeat(role="decode", instance_id="d0", running=3)
    assert decode(encode(hb), bus_pb2.Heartbeat) == hb
    with pytest.raises(MessageDecodeError, match="epd.v1.Heartbeat"):
        decode(b"\xff\xff\xff", bus_pb2.Heartbeat)
    with pytest.raises(TypeError):
        encode("not a message")  # type: ignore[arg-type]
