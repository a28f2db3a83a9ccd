"""Benchmark helper: the elementwise kernels (write_kv, rms_norm, rotary) against the torch twin."""

from __future__ import annotations

import torch
from _gpu_harness import BF16_TOL, DEV, HKV, HQ, PAGE, D, Run, bench_ms

from services.kernels import torch_backend as ref
from services.kernels.triton_kv import write_kv
from services.kernels.triton_norm import rms_norm
from services.kernels.triton_rotary import rotary


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
    print(
        f"  write_kv: triton {bench_ms(lambda: write_kv(key, value, k1, v1, slots)):.3f} ms, "
        f"torch {bench_ms(lambda: ref.write_kv(key, value, k0, v0, slots)):.3f} ms"
    )
    x = torch.randn(t, 4096, device=DEV, dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5

    def norm_ok() -> None:
        (a, ra), (b, rb) = rms_norm(x, w, 1e-6, r), ref.rms_norm(x, w, 1e-6, r)
        assert torch.equal(ra, rb), "residual sums differ"
        torch.testing.assert_close(a, b, **BF16_TOL)

    run.check("rms_norm bf16 4096x4096 + residual", norm_ok)
    print(
        f"  rms_norm: triton {bench_ms(lambda: rms_norm(x, w, 1e-6, r)):.3f} ms, "
        f"torch {bench_ms(lambda: ref.rms_norm(x, w, 1e-6, r)):.3f} ms"
    )
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
    print(
        f"  rotary: triton {bench_ms(lambda: rotary(pos, q, k, cache, True)):.3f} ms, "
        f"torch {bench_ms(lambda: ref.rotary(pos, q, k, cache, True)):.3f} ms"
    )
