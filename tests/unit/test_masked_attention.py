"""torch_backend.masked_attention (Gemma 3's sliding windows and images seen whole)
against dense attention with the mask written out, over a paged cache whose blocks are
shuffled: two sequences, queries at the end of each context, windows that cut the
context, rows that see later keys of their image."""

from __future__ import annotations

import pytest
import torch

from services.engine.step_meta import attn_meta
from services.kernels.torch_backend import masked_attention

BS, HQ, HKV, D = 4, 4, 2, 8


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ctx, qlens = [23, 9], [7, 9]  # sequence 0 extends a cached prefix; 1 is a prefill
    keys = [torch.randn(c, HKV, D, generator=g) for c in ctx]
    values = [torch.randn(c, HKV, D, generator=g) for c in ctx]
    blocks = torch.randperm(16, generator=g).tolist()
    tables = [blocks[:6], blocks[6:9]]
    k_cache, v_cache = torch.zeros(16, BS, HKV, D), torch.zeros(16, BS, HKV, D)
    for table, k, v in zip(tables, keys, values, strict=True):
        for p in range(k.shape[0]):
            k_cache[table[p // BS], p % BS] = k[p]
            v_cache[table[p // BS], p % BS] = v[p]
    q = torch.randn(sum(qlens), HQ, D, generator=g)
    meta = attn_meta(qlens, ctx, tables, [0] * sum(qlens), torch.device("cpu"))
    return q, keys, values, k_cache, v_cache, meta, ctx, qlens


def _dense(q, keys, values, ctx, qlens, window, last_seen):
    out, row = [], 0
    for k, v, c, n in zip(keys, values, ctx, qlens, strict=True):
        for i in range(n):
            pos = c - n + i
            last = pos if last_seen is None else int(last_seen[row])
            seen = torch.tensor(
                [kp <= last and (window is None or pos - kp < window) for kp in range(c)]
            )
            kk, vv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
            s = torch.einsum("hd,khd->hk", q[row], kk) * D**-0.5
            s = s.masked_fill(~seen, float("-inf")).softmax(-1)
            out.append(torch.einsum("hk,khd->hd", s, vv))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("image", [False, True])
def test_windows_and_whole_images_match_the_dense_mask(window, image):
    q, keys, values, k_cache, v_cache, meta, ctx, qlens = _case()
    last_seen = None
    if image:  # sequence 0's positions 17..20 and sequence 1's 2..5 are images
        pos = list(range(16, 23)) + list(range(9))
        last_seen = torch.tensor(pos)
        last_seen[1:5] = 20
        last_seen[7 + 2 : 7 + 6] = 5
    got = masked_attention(q, k_cache, v_cache, meta, D**-0.5, window, last_seen)
    want = _dense(q, keys, values, ctx, qlens, window, last_seen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
