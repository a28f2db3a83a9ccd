"""Benchmark helper: paged decode and extend attention against the torch twin, with timings.

Decode bandwidth is reported as a fraction of the device-to-device copy (goal >= 70 %);
SDPA and, when installed, flash_attn over contiguous KV are timed beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from _gpu_harness import BF16_TOL, DEV, HKV, HQ, PAGE, D, Run, bench_ms

from services.kernels import torch_backend as ref
from services.kernels.metadata import AttentionMetadata
from services.kernels.triton_attention import choose_num_splits, decode_attention
from services.kernels.triton_extend import extend_attention

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # optional baseline
    flash_attn_varlen_func = flash_attn_with_kvcache = None

HAS_FLASH_ATTN = flash_attn_with_kvcache is not None


def paged(lens: list[int], qlens: list[int], dtype: torch.dtype, seed: int = 0):
    """Random K/V caches over scattered blocks and the metadata of one step."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    nblk = [math.ceil(n / PAGE) for n in lens]
    total = sum(nblk) + 1
    k = torch.randn(total, PAGE, HKV, D, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(total, PAGE, HKV, D, device=DEV, dtype=dtype, generator=gen)
    ids = torch.randperm(total, device=DEV, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=DEV)
    used, slots = 0, []
    for i, (n, q) in enumerate(zip(nblk, qlens, strict=True)):
        table[i, :n] = ids[used : used + n]
        used += n
        pos = torch.arange(lens[i] - q, lens[i], device=DEV)
        slots.append(table[i, pos // PAGE].long() * PAGE + pos % PAGE)
    qsl = torch.tensor([0] + qlens, device=DEV).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=table,
        slot_mapping=torch.cat(slots),
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
    )
    return k, v, meta


DECODE_CASES = [(1, [512]), (1, [32768]), (8, [4096]), (64, [2048]), (256, [512]), (256, None)]


def decode_case(run: Run, lens: list[int], dtype: torch.dtype, tol: dict) -> None:
    """Auto, single and 4-way split decode against the twin on one batch."""
    batch = len(lens)
    k, v, meta = paged(lens, [1] * batch, dtype)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=dtype)
    want = ref.attention(q, k, v, meta, D**-0.5)
    auto = choose_num_splits(batch, HKV, meta.max_seq_len, DEV)
    for splits in (None, 1, 4):

        def ok(splits: int | None = splits) -> None:
            got = decode_attention(
                q, k, v, meta.block_tables, meta.seq_lens, meta.max_seq_len, D**-0.5, splits
            )
            torch.testing.assert_close(got, want, **tol)

        label = f"auto={auto}" if splits is None else str(splits)
        run.check(f"decode {dtype} B={batch} max_ctx={meta.max_seq_len} splits={label}", ok)


def section_decode_correctness(run: Run) -> None:
    gen = torch.Generator().manual_seed(0)
    for batch, lens in DECODE_CASES:
        if not run.time_left("decode correctness"):
            return
        lens = lens * batch if lens else torch.randint(1, 2048, (batch,), generator=gen).tolist()
        decode_case(run, lens, torch.bfloat16, BF16_TOL)
    for dtype in (torch.float16, torch.float32):
        decode_case(run, [3000, 17, 700], dtype, {"atol": 5e-3, "rtol": 5e-3})


def decode_speed_case(batch: int, ctx: int, copy_bw: float) -> None:
    """Triton decode time and bandwidth, with SDPA / flash_attn over contiguous KV beside it."""
    k, v, meta = paged([ctx] * batch, [1] * batch, torch.bfloat16)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    ms = bench_ms(lambda: decode_attention(q, k, v, meta.block_tables, meta.seq_lens, ctx, D**-0.5))
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    frac = kv_bytes / (ms * 1e-3) / copy_bw
    goal = "GOAL MET" if frac >= 0.7 else "GOAL MISSED"
    line = f"  decode B={batch} ctx={ctx}: triton {ms:.3f} ms, {kv_bytes / ms / 1e6:.0f} GB/s"
    line += f" = {frac:.0%} of copy ({goal})"
    kc = k[meta.block_tables.long()].reshape(batch, -1, HKV, D)[:, :ctx]
    vc = v[meta.block_tables.long()].reshape(batch, -1, HKV, D)[:, :ctx]
    qs, ks, vs = q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2)
    sdpa = bench_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    line += f"; SDPA (contiguous KV) {sdpa:.3f} ms"
    if flash_attn_with_kvcache is not None:
        fa = bench_ms(
            lambda: flash_attn_with_kvcache(q[:, None], kc, vc, cache_seqlens=meta.seq_lens)
        )
        line += f"; flash_attn (contiguous KV) {fa:.3f} ms"
    print(line, flush=True)


def section_decode_speed(run: Run, copy_bw: float) -> None:
    for batch, ctx in [(1, 32768), (8, 8192), (64, 4096), (256, 2048)]:
        if not run.time_left("decode timing"):
            return
        decode_speed_case(batch, ctx, copy_bw)


def section_extend(run: Run) -> None:
    cases = [([512], [512]), ([3000, 2560, 700, 40], [1000, 512, 1, 40]), ([8192], [2048])]
    for lens, qlens in cases:
        if not run.time_left("extend"):
            return
        k, v, meta = paged(lens, qlens, torch.bfloat16)
        q = torch.randn(sum(qlens), HQ, D, device=DEV, dtype=torch.bfloat16)
        want = ref.attention(q, k, v, meta, D**-0.5)

        def call(q=q, k=k, v=v, meta=meta):
            return extend_attention(
                q,
                k,
                v,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_query_len,
                D**-0.5,
            )

        run.check(
            f"extend bf16 ctx={lens} new={qlens}",
            lambda call=call, want=want: torch.testing.assert_close(call(), want, **BF16_TOL),
        )
        ms, twin = (
            bench_ms(call),
            bench_ms(lambda q=q, k=k, v=v, meta=meta: ref.attention(q, k, v, meta, D**-0.5)),
        )
        flops = sum(4 * ql * (n - ql / 2) * HQ * D for n, ql in zip(lens, qlens, strict=True))
        print(
            f"  extend: triton {ms:.3f} ms ({flops / ms / 1e9:.1f} TFLOP/s), torch SDPA twin {twin:.3f} ms",
            flush=True,
        )
    if flash_attn_varlen_func is not None and run.time_left("flash_attn prefill"):
        n = 8192
        q, kk, vv = (torch.randn(n, h, D, device=DEV, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        fa = bench_ms(lambda: flash_attn_varlen_func(q, kk, vv, cu, cu, n, n, causal=True))
        print(f"  flash_attn varlen causal prefill 8192 tokens: {fa:.3f} ms")
