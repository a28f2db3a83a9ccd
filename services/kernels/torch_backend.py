"""Plain-torch reference of every backend op; serves on CPU.

These functions define the contracts the Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.kernels.metadata import AttentionMetadata, SamplingTensors

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
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] indexed by a block list -> the first `length` rows [L, H, D]."""
    _, bs, h, d = cache.shape
    return cache[blocks].reshape(-1, h, d)[:length]


def _decode_attention(query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """One query per sequence: gather every context into a padded batch, mask the tail."""
    b, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    nblk = (meta.max_seq_len + bs - 1) // bs
    table = meta.block_tables[:, :nblk].long()
    k = k_cache[table].reshape(b, nblk * bs, hkv, d).float()
    v = v_cache[table].reshape(b, nblk * bs, hkv, d).float()
    q = query.float().view(b, hkv, hq // hkv, d)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, S]
    pad = torch.arange(nblk * bs, device=query.device)[None, :] >= meta.seq_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(query.dtype)


def _extend_attention(query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Per sequence: causal attention of the new rows over cached prefix + new rows."""
    out = torch.empty_like(query)
    hq, hkv = query.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    start = 0
    for b, (qlen, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if qlen == 0:
            continue
        blocks = meta.block_tables[b, : (ctx + bs - 1) // bs].long()
        k = _gather(k_cache, blocks, ctx).transpose(0, 1)[None].to(query.dtype)
        v = _gather(v_cache, blocks, ctx).transpose(0, 1)[None].to(query.dtype)
        q = query[start : start + qlen].transpose(0, 1)[None]
        if qlen == ctx:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hkv
            )
        else:
            rows = torch.arange(qlen, device=query.device)[:, None] + (ctx - qlen)
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv
            )
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


def attention(query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if meta.is_decode_only:
        return _decode_attention(query, k_cache, v_cache, meta, scale)
    return _extend_attention(query, k_cache, v_cache, meta, scale)


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


class TorchBackend:
    """Backend object over the functions above (see ``services.kernels.backend``)."""

    name = "torch"
    write_kv = staticmethod(write_kv)
    attention = staticmethod(attention)
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)
    sample = staticmethod(sample)
