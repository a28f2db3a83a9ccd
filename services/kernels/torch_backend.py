"""Plain-torch reference of every backend op; serves on CPU.

These functions define the contracts the Triton kernels are tested against.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.kernels import kv_quant
from services.kernels.metadata import AttentionMetadata, SamplingTensors
from services.kernels.quant import QuantizedWeight

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the only source of a row's random numbers."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_quant.is_quantized(k_cache):
        fmt = kv_quant.format_of(k_cache)
        key, value = kv_quant.quantize(key, fmt), kv_quant.quantize(value, fmt)
    nb, bs, h, w = k_cache.shape
    k_cache.view(nb * bs, h, w).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, w).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """[num_blocks, bs, H, D] indexed by a block list -> the first `length` rows [L, H, D]
    as values of ``dtype`` (a quantized cache's rows dequantized)."""
    _, bs, h, w = cache.shape
    # index_select copies whole blocks; advanced indexing is several times slower on CPU.
    return kv_quant.readable(cache.index_select(0, blocks).view(-1, h, w)[:length], dtype)


@dataclass
class _DecodeGroup:
    """Decode sequences of similar length, attended as one padded batch."""

    rows: torch.Tensor  # [g] int64, their query rows (= output rows)
    blocks: torch.Tensor  # [g * nblk] int64, the first nblk block ids of each, flattened
    length: int  # longest context of the group
    mask: torch.Tensor | None  # [g, 1, 1, length] bool, True = attend; None if all equal


def _decode_groups(meta: AttentionMetadata, rows: list[int], seqs: list[int], bs: int):
    """Sort by length and cut a group where a context needs < 7/8 of the longest's blocks,
    so padding stays small whatever the spread of lengths (one group when all are alike)."""
    lens = meta.seq_lens_cpu
    order = sorted(range(len(seqs)), key=lambda i: -lens[seqs[i]])
    cuts: list[list[int]] = []
    for i in order:
        if cuts and -(-lens[seqs[i]] // bs) * 8 >= -(-lens[seqs[cuts[-1][0]]] // bs) * 7:
            cuts[-1].append(i)
        else:
            cuts.append([i])
    groups = []
    for members in cuts:
        glens = [lens[seqs[i]] for i in members]
        nblk = -(-glens[0] // bs)
        sel = torch.tensor(
            [seqs[i] for i in members], dtype=torch.long, device=meta.seq_lens.device
        )
        blocks = meta.block_tables.index_select(0, sel)[:, :nblk].reshape(-1).long()
        mask = None
        if glens[-1] != glens[0]:
            pos = torch.arange(glens[0], device=sel.device)
            mask = (pos[None, :] < meta.seq_lens.index_select(0, sel)[:, None])[:, None, None, :]
        row_t = torch.tensor([rows[i] for i in members], dtype=torch.long, device=sel.device)
        groups.append(_DecodeGroup(row_t, blocks, glens[0], mask))
    return groups


# Every layer of a step attends with the same metadata: the first builds the groups.
_plan: tuple[weakref.ref | None, list[_DecodeGroup]] = (None, [])


def _cached_groups(meta: AttentionMetadata, rows: list[int], seqs: list[int], bs: int):
    global _plan
    ref, groups = _plan
    if ref is None or ref() is not meta:
        groups = _decode_groups(meta, rows, seqs, bs)
        _plan = (weakref.ref(meta), groups)
    return groups


def _decode_attention(query, k_cache, v_cache, groups: list[_DecodeGroup], scale: float, out):
    """One query per sequence, over contexts gathered block-wise, a padded batch per group."""
    hq = query.shape[1]
    hkv, w = k_cache.shape[2:]
    for grp in groups:
        g = grp.rows.shape[0]
        k = k_cache.index_select(0, grp.blocks).view(g, -1, hkv, w)[:, : grp.length]
        v = v_cache.index_select(0, grp.blocks).view(g, -1, hkv, w)[:, : grp.length]
        q = query.index_select(0, grp.rows)[:, :, None, :]  # [g, Hq, 1, D]
        # SDPA reads the [g, Hkv, L, D] views through their strides: no transposed copy.
        o = F.scaled_dot_product_attention(
            q,
            kv_quant.readable(k, q.dtype).transpose(1, 2),
            kv_quant.readable(v, q.dtype).transpose(1, 2),
            attn_mask=grp.mask,
            scale=scale,
            enable_gqa=hq != hkv,
        )
        out.index_copy_(0, grp.rows, o[:, :, 0])
    return out


def extend_one(query, k_cache, v_cache, table_row, qlen: int, ctx: int, scale: float):
    """Causal attention of one sequence's qlen new rows over its ctx cached rows."""
    hq, hkv, bs = query.shape[1], k_cache.shape[2], k_cache.shape[1]
    blocks = table_row[: (ctx + bs - 1) // bs].long()
    k = gather_blocks(k_cache, blocks, ctx, query.dtype).transpose(0, 1)[None]
    v = gather_blocks(v_cache, blocks, ctx, query.dtype).transpose(0, 1)[None]
    q = query.transpose(0, 1)[None]
    mask = None
    if qlen != ctx:
        rows = torch.arange(qlen, device=query.device)[:, None] + (ctx - qlen)
        mask = torch.arange(ctx, device=query.device)[None, :] <= rows
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=hq != hkv
    )
    return o[0].transpose(0, 1)


def query_starts(meta: AttentionMetadata) -> list[int]:
    """First query row of every sequence, plus the total."""
    starts = [0]
    for q in meta.query_lens_cpu:
        starts.append(starts[-1] + q)
    return starts


def extend_rows(
    query,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    out,
    starts,
    min_context: int = 0,
    one=None,
):
    """Attention of every sequence with more than one new row (and a context of at least
    ``min_context``), one by one, into out; ``one``: extend_one's contract (the cpu
    backend passes its own)."""
    one = one or extend_one
    for b, (qlen, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if qlen > 1 and ctx >= min_context:
            s = starts[b]
            out[s : s + qlen] = one(
                query[s : s + qlen], k_cache, v_cache, meta.block_tables[b], qlen, ctx, scale
            )


def attention(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Sequences with one new row go through the grouped decode path, the others one by one."""
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    starts = query_starts(meta)
    dec = [b for b, q in enumerate(meta.query_lens_cpu) if q == 1]
    if dec:
        groups = _cached_groups(meta, [starts[b] for b in dec], dec, k_cache.shape[1])
        _decode_attention(query, k_cache, v_cache, groups, scale, out)
    if len(dec) < meta.num_seqs:
        extend_rows(query, k_cache, v_cache, meta, scale, out, starts)
    return out


def masked_attention(
    query,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    last_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention`` with two more rules, one sequence at a time: a key more than
    ``window`` - 1 positions before its query is not seen (sliding-window layers), and
    query row i sees keys up to position ``last_seen[i]`` ([T] int64; None: its own),
    later ones included (an image's tokens see the whole image, Gemma 3), so those keys
    must be in the cache when the row is computed."""
    out = torch.empty_like(query)
    bs = k_cache.shape[1]
    for b, s in enumerate(query_starts(meta)[:-1]):
        q, ctx = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        if q == 0:
            continue
        first = 0 if window is None else max(0, ctx - q + 1 - window)
        lo = first // bs * bs  # whole blocks from the first key any row sees
        table = meta.block_tables[b, lo // bs : (ctx + bs - 1) // bs].to(torch.long)
        k = gather_blocks(k_cache, table, ctx - lo, query.dtype)
        v = gather_blocks(v_cache, table, ctx - lo, query.dtype)
        qpos = torch.arange(ctx - q, ctx, device=query.device)[:, None]
        kpos = torch.arange(lo, ctx, device=query.device)[None, :]
        last = qpos if last_seen is None else last_seen[s : s + q, None]
        seen = kpos <= last
        if window is not None:
            seen &= qpos - kpos < window
        o = F.scaled_dot_product_attention(
            query[s : s + q].transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=seen,
            scale=scale,
            enable_gqa=True,
        )
        out[s : s + q] = o.transpose(0, 1)
    return out


def grouped_gemm(x, weight, rows, block_expert, block_m: int = 16) -> torch.Tensor:
    """Twin of ``triton_moe.grouped_gemm``: slot i = x[rows[i]] @ weight[e].T in fp32,
    rounded once, for e the expert of slot i's block; padding slots (rows -1) zero."""
    y = torch.zeros(rows.numel(), weight.shape[1], dtype=x.dtype, device=x.device)
    for b, e in enumerate(block_expert.tolist()):
        r = rows[b * block_m : (b + 1) * block_m]
        valid = r >= 0
        prod = x[r[valid]].float() @ weight[e].float().t()
        y[b * block_m : (b + 1) * block_m][valid] = prod.to(x.dtype)
    return y


def rms_norm(x, weight, eps: float, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, residual)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    rot = cos.shape[-1] * 2
    xr = x[..., :rot]
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    xf1, xf2 = x1.float(), x2.float()
    o1 = xf1 * cos - xf2 * sin
    o2 = xf2 * cos + xf1 * sin
    x1.copy_(o1)
    x2.copy_(o2)


def rotary(positions, query, key, cos_sin_cache, is_neox: bool) -> None:
    cs = cos_sin_cache[positions]  # [T, rot]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    _rotate(query, cos, sin, is_neox)
    _rotate(key, cos, sin, is_neox)


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
):
    if isinstance(weight, QuantizedWeight):  # no kernel of its own here: a full copy per call
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def mask_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (masked entries become -inf)."""
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    logits = logits / temp[:, None]
    if not t.no_top_k:
        k = t.top_k.long().clamp(min=0)
        k = torch.where(k == 0, torch.full_like(k, logits.shape[-1]), k).clamp(max=logits.shape[-1])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not t.no_top_p:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = (probs.cumsum(dim=-1) - probs) >= t.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if not t.no_min_p:
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * t.min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def gumbel_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(mix_seed(seed, position))
    u = torch.rand(vocab, generator=gen, dtype=torch.float32)
    u = u.clamp_(min=1e-10, max=1.0 - 1e-7)
    return (-torch.log(-torch.log(u))).to(device)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    masked = mask_logits(logits, t)
    seeds, positions = t.seeds.tolist(), t.positions.tolist()
    noise = torch.stack(
        [
            gumbel_noise(s, p, logits.shape[-1], logits.device)
            for s, p in zip(seeds, positions, strict=True)
        ]
    )
    sampled = (masked + noise).argmax(dim=-1)
    return torch.where(t.temperature > 0, sampled, greedy)


def greedy_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(x, weight).float().argmax(dim=-1)


class TorchBackend:
    """Backend object over the functions above (see ``services.kernels.backend``)."""

    name = "torch"
    stack_max_rows = 0  # no one-call step: verifications run as extends
    write_kv = staticmethod(write_kv)
    attention = staticmethod(attention)
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)
    sample = staticmethod(sample)
    linear = staticmethod(linear)
    silu_mul = staticmethod(silu_mul)
    greedy_head = staticmethod(greedy_head)

    @staticmethod
    def decode_stack(stack, positions, hidden, kv_caches, meta, aux_layers=()) -> None:
        return None  # no fused step: torch ops are already one call per layer op

    @staticmethod
    def decode_greedy(stack, embed, head, tokens, positions, kv_caches, meta, steps) -> None:
        return None  # the model runner loops over the steps
