"""Attention metadata of a step, built from plain lists by the model runner.

A verification step of speculative decoding (every request decoding its last known token
plus drafts, no prefill) is described row by row (``verify_rows_meta``): each query row
is its own one-token "sequence" whose context ends at its own position. Attention reads
the same keys as the extend path would (row i of a sequence attends to positions
``0 .. pos_i``), but the step now has the shape of a plain decode step, so a backend that
runs decode steps in one call (the cpu backend's ``decode_stack``) takes it too.
"""

from __future__ import annotations

import torch

from services.kernels.metadata import AttentionMetadata, OutputRows


def to_tensor(values, dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` (no sync on the way)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def attn_meta(
    qlens: list[int],
    seqlens: list[int],
    tables: list[list[int]],
    slots: list[int],
    device: torch.device,
) -> AttentionMetadata:
    """Packed metadata of sequences with these query lengths, context lengths (after the
    step), block tables and new tokens' slots."""
    width = max((len(t) for t in tables), default=0)
    # One tensor from padded lists: a tensor per row costs more at hundreds of requests.
    rows = [t + [0] * (width - len(t)) for t in tables] if width else [[0]] * len(tables)
    table = torch.tensor(rows, dtype=torch.int32).view(len(tables), max(width, 1))
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        query_start_loc=to_tensor(starts, torch.int32, device),
        seq_lens=to_tensor(seqlens, torch.int32, device),
        block_tables=table.to(device, non_blocking=True),
        slot_mapping=to_tensor(slots, torch.long, device),
        max_query_len=max(qlens, default=0),
        max_seq_len=max(seqlens, default=0),
        query_lens_cpu=qlens,
        seq_lens_cpu=seqlens,
    )


def verify_rows_meta(
    positions: list[int], row_tables: list[list[int]], slots: list[int], device: torch.device
) -> AttentionMetadata:
    """A verification step row by row: row i, at ``positions[i]`` of the sequence whose
    block table is ``row_tables[i]``, attends to positions ``0 .. positions[i]``. Every
    row's K/V is written before attention (the metadata contract), so the drafts of one
    sequence see each other causally."""
    lens = [p + 1 for p in positions]
    return attn_meta([1] * len(positions), lens, row_tables, slots, device)


def out_rows(
    rows: list[int], seqs: list[int], attn: AttentionMetadata, pos: list[int], device: torch.device
) -> OutputRows | None:
    """Rows ``rows`` of sequences ``seqs`` (the last row of each sampling sequence; with
    drafts, the last 1 + k), as one query each over its causal prefix; None when those are
    every row of a one-token-per-sequence step, in order."""
    if len(rows) == attn.num_seqs and attn.max_query_len == 1:
        return None
    sel = to_tensor(seqs, torch.long, device)
    lens = [pos[r] + 1 for r in rows]
    meta = AttentionMetadata(
        query_start_loc=to_tensor(list(range(len(seqs) + 1)), torch.int32, device),
        # Several rows of one sequence (drafts) end at different positions.
        seq_lens=to_tensor(lens, torch.int32, device)
        if len(rows) > len(set(seqs))
        else attn.seq_lens.index_select(0, sel),
        block_tables=attn.block_tables.index_select(0, sel),
        slot_mapping=to_tensor([], torch.long, device),
        max_query_len=1 if seqs else 0,
        max_seq_len=max(lens, default=0),
        query_lens_cpu=[1] * len(seqs),
        seq_lens_cpu=lens,
    )
    return OutputRows(to_tensor(rows, torch.long, device), meta)


def next_decode_meta(meta: AttentionMetadata, pos: torch.Tensor, block_size: int):
    """A pure decode step's metadata one token on: longer contexts, the next slots."""
    bs = block_size
    blocks = meta.block_tables.gather(1, (pos // bs).view(-1, 1).to(torch.int64))
    lens = [n + 1 for n in meta.seq_lens_cpu]
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens + 1,
        block_tables=meta.block_tables,
        slot_mapping=blocks.view(-1).to(torch.int64) * bs + pos % bs,
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens_cpu=meta.query_lens_cpu,
        seq_lens_cpu=lens,
    )
