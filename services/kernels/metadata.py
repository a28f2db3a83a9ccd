"""Per-step attention inputs shared by every layer and every backend."""

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
