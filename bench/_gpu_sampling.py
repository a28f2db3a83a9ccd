"""Benchmark helper: the Triton sampler against the torch twin (greedy, masks, batch order)."""

from __future__ import annotations

import time

import torch
from _gpu_harness import DEV, Run, bench_ms

from services.kernels import torch_backend as ref
from services.kernels.metadata import SamplingTensors
from services.kernels.triton_sampling import sample


def sampling_tensors(
    b: int, temp: float, top_k: int, top_p: float, min_p: float
) -> SamplingTensors:
    full = lambda x, dt: torch.full((b,), x, dtype=dt, device=DEV)  # noqa: E731
    return SamplingTensors(
        temperature=full(temp, torch.float32),
        top_k=full(top_k, torch.int32),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        seeds=full(7, torch.int64),
        positions=torch.arange(b, device=DEV),
        all_greedy=temp == 0,
        no_top_k=top_k == 0,
        no_top_p=top_p >= 1,
        no_min_p=min_p == 0,
    )


def masks_and_order_ok(logits: torch.Tensor, masked: SamplingTensors) -> None:
    """No masked token is drawn, and permuting the batch permutes the drawn tokens."""
    b = logits.shape[0]
    got = sample(logits, masked)
    allowed = torch.isfinite(ref.mask_logits(logits, masked))
    assert bool(allowed.gather(1, got[:, None]).all()), "a masked token was drawn"
    perm = torch.randperm(b, device=DEV)
    fields = {
        f: getattr(masked, f)[perm]
        for f in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")
    }
    t2 = SamplingTensors(**fields, all_greedy=False, no_top_k=False, no_top_p=False, no_min_p=False)
    assert torch.equal(sample(logits[perm], t2), got[perm]), "batch order changed the tokens"


def section_sampling(run: Run) -> None:
    b, vocab = 256, 128 * 1024
    logits = torch.randn(b, vocab, device=DEV) * 4
    greedy, plain = sampling_tensors(b, 0.0, 0, 1.0, 0.0), sampling_tensors(b, 0.8, 0, 1.0, 0.0)
    masked = sampling_tensors(b, 0.8, 50, 0.9, 0.05)
    run.check(
        "sample greedy == argmax (256 x 128k)",
        lambda: torch.equal(sample(logits, greedy), logits.argmax(-1)) or 1 / 0,
    )
    run.check(
        "sample masks + batch-order invariance (256 x 128k)",
        lambda: masks_and_order_ok(logits, masked),
    )
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
