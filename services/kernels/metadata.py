"""Per-step inputs shared by every layer and every backend, and the weights of a decoder
stack as a backend that runs a whole decode step in one call sees them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Packed variable-length batch: B sequences, T new tokens in all.

    Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; those tokens
    sit at the last positions of its context, so query row i of b (0-based inside b)
    attends causally to key positions ``0 .. seq_lens[b] - query_len_b + i``.
    The KV of the new tokens is already written to the cache when attention runs.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0; only the first ceil(seq_len / block_size) entries are read
    slot_mapping: (
        torch.Tensor
    )  # [T] int64, cache slot (block_id * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    # Host copies of the lengths, so the torch path never syncs with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class OutputRows:
    """The rows whose hidden states a step needs (the S sampled rows, in sampling order).

    Beyond its K/V, the last decoder layer computes only these: the other rows of a
    prefill chunk feed no later layer and no logits. ``meta`` is one query per kept row,
    over that row's whole sequence (its K/V, this step's included, is written by then).
    """

    rows: torch.Tensor  # [S] int64, query rows of the step
    meta: AttentionMetadata  # S sequences, one query each


@dataclass
class SamplingTensors:
    """Per-row sampling controls for one step's logits (B rows)."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int32; 0 means off
    top_p: torch.Tensor  # [B] float32; 1 means off
    min_p: torch.Tensor  # [B] float32; 0 means off
    seeds: torch.Tensor  # [B] int64; random numbers come from (seed, position) only
    positions: torch.Tensor  # [B] int64; index of the token being sampled in its sequence
    all_greedy: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool


@dataclass
class DecoderLayerWeights:
    """One Llama-family layer. Linear weights are [out, in] as ``F.linear`` takes them, or
    ``QuantizedWeight``s (``Backend.linear`` takes either); the fused projections are qkv
    (q | k | v) and gate_up (gate | up)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm of q and k (Qwen3), else None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass
class DecoderStack:
    """A Llama-family decoder stack: its layers, final norm and rotary table (NeoX style).

    Every RMSNorm of the stack uses ``eps``; the activation is SiLU. A model builds this
    once after loading; ``Backend.decode_stack`` may run a whole decode step from it.
    """

    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    rope: torch.Tensor  # [max_positions, rot_dim]: cos | sin
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
