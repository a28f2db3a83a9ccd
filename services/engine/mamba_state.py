"""Recurrent state of hybrid models (Nemotron-H's Mamba layers), one slot per request.

A slot holds, for every Mamba layer, the convolution window and the SSM state of one
request: a fixed size whatever its length. The slots come out of the same memory budget
as the KV blocks (``kv_cache_memory_mb`` pays for ``max_num_seqs`` slots first, the
blocks get the rest), and the block manager hands a slot out with a request's first
blocks and takes it back with them (``BlockManager(num_state_slots=...)``): a request
without a slot waits like one without blocks, and a decode instance without one refuses
an import at reservation. Nothing allocates state elsewhere.

Why prefix caching is off for hybrid models: a cached block carries the KV of its
tokens, but the recurrent state after them is a running summary of every token before,
kept only at the request's end. Reusing a prefix would need a state snapshot at each
block boundary (a slot's bytes every ``block_size`` tokens); until that pays for itself,
every request computes its whole prompt.

Why speculative decoding is refused: rejected drafts would have to be undone in the
recurrent state, which needs a snapshot per draft position; the engine says so at start.

Over the fleet the state travels with the KV: ``export`` appends it to the exported KV
blocks as ``state_blocks`` extra blocks of the same shape (its bytes, zero-padded), so
the hand-off's transport, framing and shape check stay those of plain KV; ``adopt``
splits them off again.
"""

from __future__ import annotations

import torch

from services.engine.kv_cache import MIB, KVCachePool, block_bytes

_STATE_DTYPE = torch.float32  # the SSM state accumulates over the whole sequence


class MambaStatePool:
    """``conv`` [layers, slots, conv_dim, K - 1] and ``ssm`` [layers, slots, heads,
    head_dim, state_size]; a slot id indexes dim 1 of both."""

    def __init__(self, num_layers: int, num_slots: int, shapes, device: torch.device):
        conv_shape, ssm_shape = shapes
        self.num_slots = num_slots
        self.conv = torch.zeros(
            num_layers, num_slots, *conv_shape, dtype=_STATE_DTYPE, device=device
        )
        self.ssm = torch.zeros(num_layers, num_slots, *ssm_shape, dtype=_STATE_DTYPE, device=device)

    @staticmethod
    def slot_bytes(num_layers: int, shapes) -> int:
        itemsize = torch.empty((), dtype=_STATE_DTYPE).element_size()
        return num_layers * sum(_numel(s) for s in shapes) * itemsize

    def reset(self, slots: list[int]) -> None:
        """A request starting from its first token starts from zero state."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        self.conv.index_fill_(1, idx, 0.0)
        self.ssm.index_fill_(1, idx, 0.0)

    def read(self, slot: int) -> torch.Tensor:
        """The slot's state as flat bytes on the host."""
        parts = [self.conv[:, slot].reshape(-1), self.ssm[:, slot].reshape(-1)]
        return torch.cat(parts).cpu().view(torch.uint8)

    def write(self, slot: int, data: torch.Tensor) -> None:
        """Inverse of ``read``; ``data`` holds at least the slot's bytes."""
        values = data[: self.slot_bytes_here].view(_STATE_DTYPE).to(self.conv.device)
        n = self.conv[:, slot].numel()
        self.conv[:, slot] = values[:n].view_as(self.conv[:, slot])
        self.ssm[:, slot] = values[n:].view_as(self.ssm[:, slot])

    @property
    def slot_bytes_here(self) -> int:
        return (self.conv[:, 0].numel() + self.ssm[:, 0].numel()) * self.conv.element_size()


class HybridCache:
    """The KV pool of the attention layers and the state pool of the Mamba layers, with
    the per-layer view the model reads (``layers``)."""

    def __init__(self, kv: KVCachePool, state: MambaStatePool, model):
        self.kv, self.state = kv, state
        self.layers = model.layer_caches(kv.layers, state.conv, state.ssm)
        per_block = kv.data[:, :, 0].numel() * kv.data.element_size()
        # Whole KV blocks a slot's bytes fill (a hand-off carries them so).
        self.state_blocks = -(-state.slot_bytes_here // per_block)

    @classmethod
    def build(cls, model, config, dtype, device) -> HybridCache:
        c, m = config, model
        shapes = m.state_shapes
        slots = c.max_num_seqs
        kv_args = (c.block_size, m.num_kv_heads, m.head_dim, dtype, device)
        if c.num_kv_blocks is not None:
            kv = KVCachePool(m.num_kv_layers, c.num_kv_blocks, *kv_args)
        else:
            state_mb = slots * MambaStatePool.slot_bytes(m.num_state_layers, shapes) / MIB
            if state_mb >= c.kv_cache_memory_mb:
                raise ValueError(
                    f"kv_cache_memory_mb {c.kv_cache_memory_mb} does not cover the recurrent "
                    f"state of max_num_seqs={slots} requests ({state_mb:.1f} MiB)"
                )
            per_block = block_bytes(m.num_kv_layers, *kv_args[:3], dtype)
            blocks = int((c.kv_cache_memory_mb - state_mb) * MIB // per_block)
            kv = KVCachePool(m.num_kv_layers, blocks, *kv_args)
        return cls(kv, MambaStatePool(m.num_state_layers, slots, shapes, device), model)

    def export(self, kv_blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """KV blocks [2, L, n, ...] (host) with the slot's state as ``state_blocks`` more."""
        tail = torch.zeros(
            (*kv_blocks.shape[:2], self.state_blocks, *kv_blocks.shape[3:]), dtype=kv_blocks.dtype
        )
        flat = tail.view(torch.uint8).view(-1)
        data = self.state.read(slot)
        flat[: data.numel()] = data
        return torch.cat([kv_blocks, tail], dim=2)

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``export``: (KV blocks, the state's bytes)."""
        n = blocks.shape[2] - self.state_blocks
        tail = blocks[:, :, n:].contiguous().view(torch.uint8).view(-1)
        return blocks[:, :, :n], tail


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
