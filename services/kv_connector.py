"""Moving a request's KV blocks from a prefill instance to a decode instance.

``KVSender`` / ``KVReceiver`` are the contract; the NATS implementation below chunks
the blocks under the server's max_payload with acknowledged flow control
(services/bus/chunked.py). A faster transport (NIXL, RDMA, shared memory) only has to
implement the same two methods.
"""

from __future__ import annotations

from typing import Protocol

import torch

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.chunk_receiver import ChunkReceiver
from services.bus.chunked import send_chunked
from services.bus.codec import dtype_name, tensor_from_bytes
from services.bus.connection import Bus
from services.bus.messages import decode, encode


class KVSender(Protocol):
    async def send(
        self,
        decode_id: str,
        transfer_id: str,
        request_id: str,
        kv: torch.Tensor,
        num_tokens: int,
        timeout_s: float,
    ) -> int: ...


class KVReceiver(Protocol):
    async def receive(
        self, transfer_id: str, timeout_s: float
    ) -> tuple[bus_pb2.KvHeader, torch.Tensor]: ...


class NatsKVSender:
    def __init__(self, bus: Bus):
        self.bus = bus

    async def send(self, decode_id, transfer_id, request_id, kv, num_tokens, timeout_s) -> int:
        """Send [2, layers, blocks, block, heads, dim] KV; returns the payload bytes. The
        engine exports KV to host memory (KVCachePool.read_blocks); a device tensor is
        staged here as a fallback."""
        kv = kv.cpu().contiguous()
        layout = bus_pb2.KvLayout(
            num_layers=kv.shape[1],
            num_kv_heads=kv.shape[4],
            head_dim=kv.shape[5],
            block_size=kv.shape[3],
            dtype=dtype_name(kv.dtype),
            shape=list(kv.shape),
        )
        payload = kv.view(torch.uint8).reshape(-1).numpy()
        header = bus_pb2.KvHeader(
            request_id=request_id, num_tokens=num_tokens, layout=layout, total_bytes=payload.nbytes
        )
        await send_chunked(
            self.bus,
            subjects.kv(decode_id),
            encode(header),
            memoryview(payload),
            timeout_s=timeout_s,
            transfer_id=transfer_id,
        )
        return payload.nbytes


class NatsKVReceiver:
    """Reassembles KV sent to this decode instance and validates it against our layout."""

    def __init__(self, bus: Bus, instance_id: str, expected: tuple[int, int, int, int, str]):
        # (layers, block_size, kv_heads, head_dim, dtype) of this instance's KV pool
        self.expected = expected
        self.chunks = ChunkReceiver(bus, subjects.kv(instance_id))

    async def start(self) -> None:
        await self.chunks.start()

    async def close(self) -> None:
        await self.chunks.close()

    def refuse(self, transfer_id: str, reason: str) -> None:
        """Stop a transfer this instance will not adopt (its sender gets an error)."""
        self.chunks.refuse(transfer_id, reason)

    async def receive(self, transfer_id: str, timeout_s: float):
        got = await self.chunks.receive(transfer_id, timeout_s)
        header = decode(got.header, bus_pb2.KvHeader)
        lay = header.layout
        layers, block, heads, dim, dtype = self.expected
        if (
            lay.num_layers,
            lay.block_size,
            lay.num_kv_heads,
            lay.head_dim,
            lay.dtype,
        ) != self.expected:
            raise ValueError(f"KV layout {lay} does not match this instance's {self.expected}")
        shape = [2, layers, None, block, heads, dim]
        # The payload is private to this transfer (claimed once): no copy needed.
        kv = tensor_from_bytes(
            got.payload, lay.dtype, list(lay.shape), expected_shape=shape, take_ownership=True
        )
        return header, kv
