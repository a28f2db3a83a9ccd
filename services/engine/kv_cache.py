"""The paged KV pool: one preallocated tensor, viewed as (K, V) per layer."""

from __future__ import annotations

import torch

from services.kernels import kv_quant

MIB = 1 << 20


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's vector of one head: ``head_dim``, or in a quantized cache
    its codes and scale (services/kernels/kv_quant.py)."""
    return kv_quant.row_width(head_dim) if kv_quant.quantized_dtype(dtype) else head_dim


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * itemsize


class KVCachePool:
    """``data`` is [2, layers, blocks, block_size, kv_heads, width]; block ids index dim 2.
    ``width`` is the head size, or for a quantized cache (``dtype`` int8, or uint8 holding
    fp8 codes) the head size plus the four bytes of each row's scale."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        if num_blocks < 1:
            raise ValueError("the KV cache budget leaves no block; raise kv_cache_memory_mb")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.data[0, i], self.data[1, i]) for i in range(num_layers)]

    @classmethod
    def from_budget(cls, budget_mb, num_layers, block_size, num_kv_heads, head_dim, dtype, device):
        per_block = block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(
            num_layers,
            int(budget_mb * MIB // per_block),
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
        )

    def read_blocks(self, block_ids: list[int], to_host: bool = False) -> torch.Tensor:
        """[2, layers, len(block_ids), block_size, kv_heads, width] copy (KV export).

        ``to_host``: the copy lands in CPU memory (pinned when the pool is on CUDA, so
        the device-to-host copy runs at full speed), ready to be sent as bytes.
        """
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        blocks = self.data.index_select(2, idx)
        if not to_host or blocks.device.type == "cpu":
            return blocks
        staged = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        return staged.copy_(blocks)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Inverse of ``read_blocks`` (KV import); ``blocks`` may sit on the host."""
        if blocks.dtype != self.data.dtype or blocks.shape[3:] != self.data.shape[3:]:
            raise ValueError(
                f"KV blocks of {blocks.dtype} {tuple(blocks.shape[3:])} rows do not fit a cache of "
                f"{self.data.dtype} {tuple(self.data.shape[3:])} (the same --kv-cache-dtype "
                "on prefill and decode instances)"
            )
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, idx, blocks.to(self.data.device))
