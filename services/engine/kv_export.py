"""Prefill role: requests whose KV leaves the engine with their first sampled token.

The step that samples it copies the request's KV blocks (every token known before the
sample: the prompt, and a migrated request's earlier output) to host memory before the
scheduler frees them, with the last hidden row a draft head needs; the output carries
both to the decode instance (``kv_import.py`` is the other end).
"""

from __future__ import annotations

import torch

from services.engine.kv_cache import KVCachePool
from services.engine.mamba_state import HybridCache
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import Scheduler


class KVExports:
    """The requests to export and what was copied for them; engine thread only."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCachePool,
        runner: ModelRunner,
        block_size: int,
        hybrid: HybridCache | None = None,
    ):
        """``hybrid``: a hybrid model's pools; its recurrent state travels after the KV."""
        self.scheduler, self.kv, self.runner, self.block_size = scheduler, kv, runner, block_size
        self.hybrid = hybrid
        self.pending: set[str] = set()  # ids whose KV goes with their next sampled token
        self._aux: dict[str, torch.Tensor] = {}  # id -> the draft head's last row [1, ...]

    def take(self, sampled: dict[str, int]) -> dict[str, torch.Tensor]:
        """The host copies of the KV of pending requests that sampled a token this step."""
        out = {}
        for rid in self.pending.intersection(sampled):
            req = self.scheduler.get_request(rid)
            n = -(-req.num_tokens // self.block_size)
            out[rid] = self.kv.read_blocks(req.block_ids[:n], to_host=True)
            if self.hybrid is not None:
                out[rid] = self.hybrid.export(out[rid], req.state_slot)
            self.pending.discard(rid)
            rows = self.runner.take_aux_rows(rid)  # a draft head's: the last one travels
            if rows is not None:
                self._aux[rid] = rows[-1:].to("cpu")
        return out

    def pop_aux(self, rid: str) -> torch.Tensor | None:
        return self._aux.pop(rid, None)
