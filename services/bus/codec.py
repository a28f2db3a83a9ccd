"""Wire codecs: protobuf messages and validated tensors (raw bytes + dtype + shape).

Tensors travel as little-endian row-major bytes; every field is checked on receipt so a
corrupt or hostile message raises ValueError instead of building a wrong tensor.
bfloat16 has no numpy type, so its bytes go through an int16 view. No pickle anywhere.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from protos.epd_pb import bus_pb2
from services.bus.messages import MessageDecodeError, decode, encode

__all__ = [
    "DTYPES",
    "MAX_DIM",
    "MAX_NDIM",
    "MessageDecodeError",
    "decode",
    "dtype_name",
    "encode",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_to_bytes",
    "tensor_to_proto",
]

# The only dtypes accepted on the wire.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,  # also fp8 KV caches (services/kernels/kv_quant.py)
    "int8": torch.int8,  # int8 KV caches
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_NDIM = 8
MAX_DIM = 2**31 - 1

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("services.bus.codec assumes a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; ValueError for dtypes outside the whitelist."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not allowed on the wire; use one of {list(DTYPES)}"
        ) from None


def tensor_to_bytes(tensor: torch.Tensor) -> tuple[bytes, str, tuple[int, ...]]:
    """Return ``(raw bytes, dtype name, shape)`` of a tensor (copied to CPU, contiguous)."""
    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    return data, name, tuple(tensor.shape)


def tensor_to_proto(tensor: torch.Tensor) -> bus_pb2.Tensor:
    """Encode a tensor as a ``bus_pb2.Tensor`` message."""
    data, name, shape = tensor_to_bytes(tensor)
    return bus_pb2.Tensor(data=data, dtype=name, shape=shape)


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_NDIM:
        raise ValueError(f"tensor has {len(dims)} dims; at most {MAX_NDIM} allowed")
    for d in dims:
        if d < 0:
            raise ValueError(f"tensor shape {dims} has a negative dimension")
        if d > MAX_DIM:
            raise ValueError(f"tensor shape {dims} has a dimension above {MAX_DIM}")
    return dims


def _check_expected(
    name: str,
    dims: tuple[int, ...],
    expected_dtype: torch.dtype | str | None,
    expected_shape: Sequence[int | None] | None,
) -> None:
    if expected_dtype is not None:
        want = expected_dtype if isinstance(expected_dtype, str) else dtype_name(expected_dtype)
        if name != want:
            raise ValueError(f"tensor dtype {name} does not match the expected {want}")
    if expected_shape is not None:
        ok = len(expected_shape) == len(dims) and all(
            e is None or e == d for e, d in zip(expected_shape, dims, strict=False)
        )
        if not ok:
            raise ValueError(f"tensor shape {list(dims)} does not match {list(expected_shape)}")


def tensor_from_bytes(
    data: bytes | bytearray | memoryview,
    dtype: str,
    shape: Sequence[int],
    *,
    expected_dtype: torch.dtype | str | None = None,
    expected_shape: Sequence[int | None] | None = None,
    take_ownership: bool = False,
) -> torch.Tensor:
    """Build a CPU tensor from raw bytes after validating dtype, shape and length.

    ``expected_shape`` may hold None for dimensions that can take any size.
    ``take_ownership``: ``data`` is a bytearray nobody else uses, so the tensor may share
    its memory instead of copying it (other types are copied regardless).
    Raises ValueError on any mismatch.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown tensor dtype {dtype!r}; expected one of {list(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    dims = _check_shape(shape)
    _check_expected(dtype, dims, expected_dtype, expected_shape)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    numel = math.prod(dims)
    if len(data) != numel * itemsize:
        raise ValueError(
            f"tensor data has {len(data)} bytes; shape {list(dims)} of {dtype} needs "
            f"{numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(dims, dtype=torch_dtype)
    # The tensor needs writable memory it owns: the caller's bytearray when handed over
    # (a received payload can be large), else a private bytearray copy.
    owned = data if take_ownership and isinstance(data, bytearray) else bytearray(data)
    raw = torch.frombuffer(owned, dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(dims)


def tensor_from_proto(
    msg: bus_pb2.Tensor,
    *,
    expected_dtype: torch.dtype | str | None = None,
    expected_shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Decode a ``bus_pb2.Tensor`` message; ValueError when it is malformed."""
    return tensor_from_bytes(
        msg.data,
        msg.dtype,
        list(msg.shape),
        expected_dtype=expected_dtype,
        expected_shape=expected_shape,
    )
