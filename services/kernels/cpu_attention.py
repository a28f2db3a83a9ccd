"""Which native kernel takes which query rows of a step's attention (the cpu backend).

Two kernels read the paged KV cache in place:

- ``epd_decode_attention`` (csrc/epd_attention.c): one query row at a time, all heads,
  over the row's whole causal prefix. Decode rows, and prefill chunks too short to tile.
- ``epd_extend_attention`` (csrc/epd_extend.c): tiles of up to ``TILE_QUERIES`` query
  vectors (consecutive positions of one sequence x the GQA group of one KV head) with an
  online softmax, so every key read serves the whole tile. Prefill/extend chunks of any
  context length: it beats torch's SDPA on every chunk shape measured, up to 4,000 x 4,000
  (``bench/prefill_attention.py``; docs/cpu-performance.md, "Prefill attention").

Chunks of a shape the tile kernel does not take go per row up to ``ROW_EXTEND_MAX``
tokens of context, to torch's SDPA beyond.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.kernels import kv_quant
from services.kernels import torch_backend as ref
from services.kernels.metadata import AttentionMetadata

TILE_QUERIES = 64  # XT_ROWS in epd_extend.c
# Chunks of at least this many rows are tiled; shorter ones go row by row.
TILE_MIN_ROWS = 2
# Longest context the per-row kernel takes for prefill rows of a chunk the tile kernel does
# not take (its K/V, re-read by every row, stays in L2 at 4 KV heads x 64); beyond, SDPA.
ROW_EXTEND_MAX = 1024


def plan_key(k_cache: torch.Tensor, hq: int) -> tuple:
    """What a plan depends on besides the step's metadata."""
    return (hq, *k_cache.shape[2:], k_cache.dtype)


def tile_kernel_takes(hq: int, hkv: int, d: int) -> bool:
    """Shapes epd_extend_attention serves (its vector loops need d % 16 == 0)."""
    return d % 16 == 0 and hq % hkv == 0 and hq // hkv <= TILE_QUERIES


class AttentionPlan:
    """Per-step inputs of the native attention, built by the first layer.

    ``rows``/``seqs``/``lens``: one entry per query row of the per-row kernel, with its own
    causal length. ``units``: [U, 5] int64 work units of the tile kernel (sequence, first
    query row, rows, position of the first row, KV head). ``sdpa_meta``: the step's metadata
    with only the sequences left to torch's ``extend_rows`` keeping their rows, or None.
    """

    def __init__(self, meta: AttentionMetadata, k_cache: torch.Tensor, hq: int):
        num_blocks, block_size, hkv, _ = k_cache.shape
        self.key = plan_key(k_cache, hq)
        self.starts = ref.query_starts(meta)
        # A quantized cache has the per-row kernel only (epd_kvq8.c).
        quantized = kv_quant.is_quantized(k_cache)
        tile = not quantized and tile_kernel_takes(hq, hkv, kv_quant.head_dim(k_cache))
        rows, seqs, lens, units, costs = [], [], [], [], []
        sdpa_lens = [0] * meta.num_seqs  # query lengths of the sequences SDPA serves
        for b, (q, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            s = self.starts[b]
            if tile and q >= TILE_MIN_ROWS:
                _tile_units(units, costs, b, s, q, ctx, hq // hkv, hkv)
            elif q >= 2 and ctx > ROW_EXTEND_MAX:
                sdpa_lens[b] = q
            else:
                rows.extend(range(s, s + q))
                seqs.extend([b] * q)
                lens.extend(range(ctx - q + 1, ctx + 1))
        self.num_rows = len(rows)
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.seqs = torch.tensor(seqs, dtype=torch.int64)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.units = torch.tensor(units, dtype=torch.int64).reshape(-1, 5)
        self._costs = costs
        # extend_rows serves every sequence of more than one row: the others get 0 here.
        self.sdpa_meta = replace(meta, query_lens_cpu=sdpa_lens) if any(sdpa_lens) else None
        self.tables = meta.block_tables.to(torch.int32).contiguous()
        self._check(meta, num_blocks, block_size)

    def _check(self, meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
        """The kernels read raw memory: a bad table must fail here, not read out of bounds."""
        width = self.tables.shape[1] if self.tables.dim() == 2 else 0
        native = set(self.seqs.tolist()) | set(self.units[:, 0].tolist())
        if native and (
            max(meta.seq_lens_cpu[b] for b in native) > width * block_size
            or self.tables.shape[0] < meta.num_seqs
        ):
            raise ValueError("attention: a context is longer than its block table")
        if self.tables.numel() and not (
            int(self.tables.min()) >= 0 and int(self.tables.max()) < num_blocks
        ):
            raise ValueError("attention: a block id outside the KV cache")

    def unit_ranges(self, parts: int) -> list[tuple[int, int]]:
        """Contiguous runs of units of about equal cost (keys x queries), one per thread."""
        n = len(self._costs)
        parts = max(1, min(parts, n))
        if parts == 1:
            return [(0, n)] if n else []
        total, ranges, lo, acc = sum(self._costs), [], 0, 0
        for i, c in enumerate(self._costs):
            acc += c
            if acc * parts >= total * (len(ranges) + 1) and len(ranges) < parts - 1:
                ranges.append((lo, i + 1))
                lo = i + 1
        if lo < n:
            ranges.append((lo, n))
        return ranges


def _tile_units(
    units: list, costs: list, b: int, start: int, q: int, ctx: int, g: int, hkv: int
) -> None:
    """Cut sequence b's q rows (positions ctx - q .. ctx - 1) into tiles x KV heads."""
    per = max(1, TILE_QUERIES // g)
    for i in range(0, q, per):
        m = min(per, q - i)
        pos0 = ctx - q + i
        for h in range(hkv):
            units.append((b, start + i, m, pos0, h))
            costs.append((pos0 + m) * (m * g + 8))  # + 8: a unit's fixed cost, in queries


def extend_one_split(query, k_cache, v_cache, table_row, qlen: int, ctx: int, scale: float):
    """``torch_backend.extend_one``'s contract, with a chunk that continues a prompt (fewer
    rows than context) cut in two: torch's CPU flash kernel skips the blocks above the
    diagonal only for ``is_causal``, and with the explicit mask such a chunk needs it
    computes every block of the rectangle (1952 rows over 2000: 84 ms, split 50)."""
    if qlen == ctx:
        return ref.extend_one(query, k_cache, v_cache, table_row, qlen, ctx, scale)
    return _continued_chunk(query, k_cache, v_cache, table_row, qlen, ctx, scale)


def _continued_chunk(query, k_cache, v_cache, table_row, qlen: int, ctx: int, scale: float):
    """Causal attention of qlen new rows over ctx > qlen cached rows, as two flash calls:
    every row sees the whole prefix (ctx - qlen keys, no mask) and its causal part of the
    last qlen keys (a square: is_causal), merged by their log-sum-exps (within ~4e-7 of
    the masked call)."""
    hq, bs = query.shape[1], k_cache.shape[1]
    group, p = hq // k_cache.shape[2], ctx - qlen
    blocks = table_row[: (ctx + bs - 1) // bs].long()
    # [1, Hq, ctx, D]: the flash op has no GQA; the copy is ~2 % of the call
    k = ref.gather_blocks(k_cache, blocks, ctx, query.dtype).transpose(0, 1)
    v = ref.gather_blocks(v_cache, blocks, ctx, query.dtype).transpose(0, 1)
    k, v = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
    q = query.transpose(0, 1)[None]
    o1, lse1 = _FLASH(q, k[:, :, :p], v[:, :, :p], 0.0, False, scale=scale)
    o2, lse2 = _FLASH(q, k[:, :, p:], v[:, :, p:], 0.0, True, scale=scale)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_()[..., None], (lse2 - top).exp_()[..., None]
    o = (o1 * w1 + o2 * w2) / (w1 + w2)  # [1, Hq, qlen, D]
    return o[0].transpose(0, 1)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
