"""GPU check of every Triton kernel: correctness against its torch twin, then timings.

    python bench/kernels_gpu.py [--budget 270]

Real sizes (32 query heads, 8 kv heads, head_dim 128, bf16, contexts 512 to 32k, batch
1 to 256). Each section prints ``PASS``/``FAIL``/``SKIP`` lines and its timings
(``triton.testing.do_bench`` medians); decode attention's bandwidth is reported as a
fraction of a device-to-device copy measured in the same run (goal >= 70 %). Sections
past ``--budget`` seconds are skipped, and a hard watchdog ends the run 60 s later.
Exit status 1 when any correctness check failed. Needs CUDA; flash_attn is optional.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from services.kernels import torch_backend as ref
from services.kernels.metadata import AttentionMetadata, SamplingTensors
from services.kernels.triton_attention import choose_num_splits, decode_attention
from services.kernels.triton_extend import extend_attention
from services.kernels.triton_kv import write_kv
from services.kernels.triton_norm import rms_norm
from services.kernels.triton_rotary import rotary
from services.kernels.triton_sampling import sample

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # optional baseline
    flash_attn_varlen_func = flash_attn_with_kvcache = None

DEV = torch.device("cuda")
HQ, HKV, D, PAGE = 32, 8, 128, 16
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


class Run:
    """PASS/FAIL bookkeeping and the time guard."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget, self.failed = time.monotonic(), budget_s, []

    def time_left(self, section: str) -> bool:
        left = self.budget - (time.monotonic() - self.start)
        if left <= 0:
            print(f"SKIP {section}: time budget of {self.budget:.0f}s spent", flush=True)
        return left > 0

    def check(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            print(f"PASS {name}", flush=True)
        except Exception as e:  # report and keep going: one failure must not hide others
            self.failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)


def bench_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


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
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=table, slot_mapping=torch.cat(slots), max_query_len=max(qlens),
        max_seq_len=max(lens), query_lens_cpu=qlens, seq_lens_cpu=lens,
    )  # fmt: skip
    return k, v, meta


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def section_elementwise(run: Run) -> None:
    t = 4096
    kv = torch.randn(t, 2 * HKV, D, device=DEV, dtype=torch.bfloat16)
    key, value = kv[:, :HKV], kv[:, HKV:]
    slots = torch.randperm(t * 2, device=DEV)[:t]
    k0 = torch.zeros(t * 2 // PAGE, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
    v0, k1, v1 = k0.clone(), k0.clone(), k0.clone()

    def kv_ok() -> None:
        ref.write_kv(key, value, k0, v0, slots)
        write_kv(key, value, k1, v1, slots)
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "caches differ"

    run.check("write_kv bf16 T=4096", kv_ok)
    print(f"  write_kv: triton {bench_ms(lambda: write_kv(key, value, k1, v1, slots)):.3f} ms, "
          f"torch {bench_ms(lambda: ref.write_kv(key, value, k0, v0, slots)):.3f} ms")  # fmt: skip
    x = torch.randn(t, 4096, device=DEV, dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5

    def norm_ok() -> None:
        (a, ra), (b, rb) = rms_norm(x, w, 1e-6, r), ref.rms_norm(x, w, 1e-6, r)
        assert torch.equal(ra, rb), "residual sums differ"
        torch.testing.assert_close(a, b, **BF16_TOL)

    run.check("rms_norm bf16 4096x4096 + residual", norm_ok)
    print(f"  rms_norm: triton {bench_ms(lambda: rms_norm(x, w, 1e-6, r)):.3f} ms, "
          f"torch {bench_ms(lambda: ref.rms_norm(x, w, 1e-6, r)):.3f} ms")  # fmt: skip
    section_rotary(run, t)


def section_rotary(run: Run, t: int) -> None:
    pos = torch.randint(0, 32768, (t,), device=DEV)
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D)
    freqs = torch.arange(32768, device=DEV, dtype=torch.float32)[:, None] * inv
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    qkv = torch.randn(t, HQ + 2 * HKV, D, device=DEV, dtype=torch.bfloat16)
    for neox in (True, False):

        def ok(neox: bool = neox) -> None:
            q0, k0 = qkv[:, :HQ].clone(), qkv[:, HQ : HQ + HKV].clone()
            q1, k1 = q0.clone(), k0.clone()
            ref.rotary(pos, q0, k0, cache, neox)
            rotary(pos, q1, k1, cache, neox)
            torch.testing.assert_close(q1, q0, **BF16_TOL)
            torch.testing.assert_close(k1, k0, **BF16_TOL)

        run.check(f"rotary bf16 T={t} neox={neox}", ok)
    q, k = qkv[:, :HQ].clone(), qkv[:, HQ : HQ + HKV].clone()
    print(f"  rotary: triton {bench_ms(lambda: rotary(pos, q, k, cache, True)):.3f} ms, "
          f"torch {bench_ms(lambda: ref.rotary(pos, q, k, cache, True)):.3f} ms")  # fmt: skip


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
            return extend_attention(q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                    meta.max_query_len, D**-0.5)  # fmt: skip

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


def sampling_tensors(
    b: int, temp: float, top_k: int, top_p: float, min_p: float
) -> SamplingTensors:
    full = lambda x, dt: torch.full((b,), x, dtype=dt, device=DEV)  # noqa: E731
    return SamplingTensors(
        temperature=full(temp, torch.float32), top_k=full(top_k, torch.int32),
        top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
        seeds=full(7, torch.int64), positions=torch.arange(b, device=DEV), all_greedy=temp == 0,
        no_top_k=top_k == 0, no_top_p=top_p >= 1, no_min_p=min_p == 0,
    )  # fmt: skip


def section_sampling(run: Run) -> None:
    b, vocab = 256, 128 * 1024
    logits = torch.randn(b, vocab, device=DEV) * 4
    greedy, plain = sampling_tensors(b, 0.0, 0, 1.0, 0.0), sampling_tensors(b, 0.8, 0, 1.0, 0.0)
    masked = sampling_tensors(b, 0.8, 50, 0.9, 0.05)
    run.check(
        "sample greedy == argmax (256 x 128k)",
        lambda: torch.equal(sample(logits, greedy), logits.argmax(-1)) or 1 / 0,
    )

    def masks_ok() -> None:
        got = sample(logits, masked)
        allowed = torch.isfinite(ref.mask_logits(logits, masked))
        assert bool(allowed.gather(1, got[:, None]).all()), "a masked token was drawn"
        perm = torch.randperm(b, device=DEV)
        fields = {
            f: getattr(masked, f)[perm]
            for f in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")
        }
        t2 = SamplingTensors(
            **fields, all_greedy=False, no_top_k=False, no_top_p=False, no_min_p=False
        )
        assert torch.equal(sample(logits[perm], t2), got[perm]), "batch order changed the tokens"

    run.check("sample masks + batch-order invariance (256 x 128k)", masks_ok)
    for name, t in (
        ("greedy", greedy),
        ("temperature", plain),
        ("top-k 50 + top-p 0.9 + min-p", masked),
    ):
        print(
            f"  sample 256 x 128k {name}: triton {bench_ms(lambda t=t: sample(logits, t)):.3f} ms",
            flush=True,
        )
    start = time.monotonic()
    ref.sample(logits, masked)
    torch.cuda.synchronize()
    print(
        f"  sample 256 x 128k top-k/top-p/min-p: torch twin {1e3 * (time.monotonic() - start):.1f} ms (one call)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=270.0, help="seconds before sections are skipped"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device")
        return 0
    faulthandler.dump_traceback_later(args.budget + 60, exit=True)  # hard watchdog
    run = Run(args.budget)
    print(
        f"device: {torch.cuda.get_device_name()}, flash_attn: {flash_attn_with_kvcache is not None}",
        flush=True,
    )
    copy_bw = copy_bandwidth()
    print(f"  device-to-device copy: {copy_bw / 1e9:.0f} GB/s", flush=True)
    for section in (
        section_elementwise,
        section_decode_correctness,
        section_extend,
        section_sampling,
    ):
        if run.time_left(section.__name__):
            run.check(section.__name__, lambda section=section: section(run))
    if run.time_left("decode timing"):
        section_decode_speed(run, copy_bw)
    print(
        f"{'FAIL' if run.failed else 'PASS'} overall in {time.monotonic() - run.start:.0f}s; failed: {run.failed}"
    )
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
