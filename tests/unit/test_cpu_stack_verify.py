"""Speculative verification through the cpu backend's one-call step (``decode_stack``,
csrc/epd_decode.c): a verification described row by row (``verify_rows_meta``: each draft
row a one-token query at its own position) gives, at one thread, bitwise the hidden
states and K/V writes of the layer path over the same rows (within fp32 rounding for a
team), and the extend path's (sequences of 1 + k query rows, the last layer on the kept
rows) within fp32 rounding: its tile kernel sums attention in another order. The outputs
of named layers (draft heads' inputs) come out of the native step bitwise as the layer
path captures them."""

from __future__ import annotations

import pytest
import torch

from services.engine.step_meta import attn_meta, out_rows, verify_rows_meta
from tests.unit.test_cpu_decode_stack import BLOCK, CASES, _llm, _run, _step

CPU = torch.device("cpu")


def _verify_step(qs: list[int], ctx: list[int], num_blocks: int, gen):
    """Sequences with q new rows each ending at position ctx - 1: (positions, the rows
    meta, the extend meta and its kept rows)."""
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    pos, slots, row_tables, tables, used = [], [], [], [], 0
    for q, n in zip(qs, ctx, strict=True):
        need = -(-n // BLOCK)
        t = blocks[used : used + need]
        used += need
        tables.append(t)
        for p in range(n - q, n):
            pos.append(p)
            slots.append(t[p // BLOCK] * BLOCK + p % BLOCK)
            row_tables.append(t)
    rows = verify_rows_meta(pos, row_tables, slots, CPU)
    extend = attn_meta(qs, ctx, tables, slots, CPU)
    seqs = [b for b, q in enumerate(qs) for _ in range(q)]
    keep = out_rows(list(range(len(pos))), seqs, extend, pos, CPU)
    return torch.tensor(pos), rows, extend, keep


def _caches(kv, gen, copies: int = 2):
    """``copies`` identical sets of random K/V caches."""
    base = [
        (torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen))
        for k, v in kv.layers
    ]
    return [[(k.clone(), v.clone()) for k, v in base] for _ in range(copies)]


def _assert_same(a, b, threads: int) -> None:
    if threads == 1:  # the same kernels in the same order: the same bits
        assert torch.equal(a, b)
    else:  # a team splits each GEMV's rows: the sums' order differs
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "kind,over", CASES, ids=[f"{k}{'-' if o else ''}{'-'.join(o)}" for k, o in CASES]
)
@pytest.mark.parametrize("qs", [[4], [2, 2], [3, 6]], ids=["1x4", "2x2", "3+6"])
def test_verify_rows_match_the_extend_path(tiny_root, threads, kind, over, qs):
    llm = _llm(tiny_root, kind, over)
    model, kv = llm.engine.model, llm.engine.kv
    gen = torch.Generator().manual_seed(len(qs) * 7 + qs[0])
    ctx = [
        int(x) + q for x, q in zip(torch.randint(1, 30, (len(qs),), generator=gen), qs, strict=True)
    ]
    pos, rows, extend, keep = _verify_step(qs, ctx, kv.num_blocks, gen)
    h = torch.randn(len(pos), model.config.hidden_size, generator=gen)
    caches_a, caches_b, caches_c = _caches(kv, gen, 3)
    calls = []
    lib = llm.engine.backend.lib
    native = lib.epd_par_decode_stack
    with torch.inference_mode():
        try:
            lib.epd_par_decode_stack = lambda *a: calls.append(1) or native(*a)
            fused = model(pos, h, caches_a, rows)
        finally:
            lib.epd_par_decode_stack = native
        layers = _run(model, pos, h, caches_b, rows, fused=False)
        by_seq = model(pos, h, caches_c, extend, keep)  # the extend path: no native step
    assert calls, "the native step did not run"
    _assert_same(fused, layers, threads)
    torch.testing.assert_close(fused, by_seq, atol=1e-5, rtol=1e-4)
    for (ka, va), (kb, vb), (kc, vc) in zip(caches_a, caches_b, caches_c, strict=True):
        _assert_same(ka, kb, threads)
        _assert_same(va, vb, threads)
        torch.testing.assert_close(ka, kc, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(va, vc, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("aux_layers", [(0,), (1, 0)], ids=["first", "both-reversed"])
def test_aux_layers_from_the_native_step(tiny_root, threads, kind, aux_layers):
    llm = _llm(tiny_root, kind, {})
    model, kv = llm.engine.model, llm.engine.kv
    gen = torch.Generator().manual_seed(3)
    meta, pos = _step([5, 17, 9], kv.num_blocks, gen)
    h = torch.randn(3, model.config.hidden_size, generator=gen)
    caches_a, caches_b = _caches(kv, gen)
    with torch.inference_mode():
        fused = llm.engine.backend.decode_stack(
            model.model.native_stack(model.rope), pos, h, caches_a, meta, aux_layers
        )
        saved = llm.engine.backend.decode_stack
        llm.engine.backend.decode_stack = lambda *a: None
        try:
            ref = model(pos, h, caches_b, meta, None, aux_layers)
        finally:
            llm.engine.backend.decode_stack = saved
    assert fused is not None, "the native step did not take the aux layers"
    assert fused[1].shape == (3, len(aux_layers) * model.config.hidden_size)
    _assert_same(fused[0], ref[0], threads)
    _assert_same(fused[1], ref[1], threads)


def test_aux_layers_it_cannot_take(tiny_root):
    """A layer the stack lacks, or one named twice: left to the layer path."""
    llm = _llm(tiny_root, "llama", {})
    model, kv, be = llm.engine.model, llm.engine.kv, llm.engine.backend
    stack = model.model.native_stack(model.rope)
    meta, pos = _step([5], kv.num_blocks, torch.Generator().manual_seed(0))
    h = torch.randn(1, model.config.hidden_size)
    n = len(stack.layers)
    with torch.inference_mode():
        assert be.decode_stack(stack, pos, h, kv.layers, meta, (n,)) is None
        assert be.decode_stack(stack, pos, h, kv.layers, meta, (0, 0)) is None
        assert be.decode_stack(stack, pos, h, kv.layers, meta, (n - 1,)) is not None
