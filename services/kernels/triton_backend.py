"""Triton backend: the same ops and contracts as ``TorchBackend``, served by Triton kernels.

Chosen by ``get_backend`` on CUDA (or by ``--attention-backend triton``). On CPU the kernels
only run under ``TRITON_INTERPRET=1`` (tests); every op validates its inputs first.
"""

from __future__ import annotations

import torch

from services.kernels.metadata import AttentionMetadata
from services.kernels.quant import QuantizedWeight
from services.kernels.torch_backend import TorchBackend
from services.kernels.triton_attention import decode_attention
from services.kernels.triton_extend import extend_attention
from services.kernels.triton_kv import write_kv
from services.kernels.triton_norm import rms_norm
from services.kernels.triton_quant import quant_linear, takes
from services.kernels.triton_rotary import rotary
from services.kernels.triton_sampling import sample


def attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D], query's dtype
    """Decode kernel (split-K chosen by length and batch) when every sequence brings exactly
    one token; the varlen extend kernel otherwise (prefill, chunked prefill, mixed batches)."""
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if meta.is_decode_only and query.shape[0] == meta.num_seqs:
        return decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale
        )
    return extend_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.max_query_len,
        scale,
    )


class TritonBackend(TorchBackend):
    """Backend object over the Triton launchers (see ``services.kernels.backend``); the
    dense ops (linear, SiLU x mul) stay torch's (cuBLAS and elementwise torch ops), but for
    quantized weights, which a Triton kernel reads from their codes."""

    name = "triton"
    write_kv = staticmethod(write_kv)
    attention = staticmethod(attention)
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)
    sample = staticmethod(sample)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedWeight) and takes(weight):
            return quant_linear(x, weight, bias)
        return super().linear(x, weight, bias)
