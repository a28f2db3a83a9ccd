"""The tile kernel of prefill/extend attention (``csrc/epd_extend.c``) against torch.

Ragged batches of several sequences: whole prompts and chunks whose query rows start
mid-context, decode rows beside them, GQA ratios 1/2/4/8, head sizes 64 and 128, contexts
across block boundaries and past 1,024 and 4,096 tokens; one and two threads. The plan
(``cpu_attention``) must send each chunk where it says, and split work across threads
without losing a unit.
"""

from dataclasses import replace

import pytest
import torch

from services.kernels import cpu_attention
from services.kernels import torch_backend as ref
from tests.helpers.threads import set_threads
from tests.unit.test_cpu_kernels import _meta

TOL = {"atol": 2e-5, "rtol": 1e-4}


threads = pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])(set_threads)


def _check(be, query_lens, seq_lens, hq, hkv, d, seed, bs=16):
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // bs) for s in seq_lens) + 8
    meta = _meta(query_lens, seq_lens, nb, bs, gen)
    kc = torch.randn(nb, bs, hkv, d, generator=gen)
    vc = torch.randn(nb, bs, hkv, d, generator=gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    got = be.attention(q, kc, vc, meta, d**-0.5)
    plan = be._plan[1]
    tiled = sorted(set(plan.units[:, 0].tolist()))
    torch.testing.assert_close(got, ref.attention(q, kc, vc, meta, d**-0.5), **TOL)
    return plan, tiled


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_ragged_batches_match_torch(be, threads, g, d):
    """Whole prompts, chunks starting mid-context (at and off block boundaries), decode rows."""
    hkv = 2
    query_lens = [1, 37, 16, 5, 1, 2, 70]
    seq_lens = [50, 37, 16 + 32, 300, 17, 1030, 1100]
    plan, tiled = _check(be, query_lens, seq_lens, g * hkv, hkv, d, seed=g * d)
    assert tiled == [1, 2, 3, 5, 6] and plan.num_rows == 2 and plan.sdpa_meta is None


@pytest.mark.parametrize("g,d", [(2, 64), (4, 128)])
def test_contexts_past_4096(be, threads, g, d):
    """A chunk deep into a 4,300-token context and a whole 1,100-token prompt."""
    plan, tiled = _check(be, [40, 1100, 1], [4300, 1100, 4200], 4 * g, 4, d, seed=5)
    assert tiled == [0, 1] and plan.num_rows == 1


def test_the_plan_tiles_every_chunk_it_can_and_sends_other_long_ones_to_sdpa(be):
    """Chunks of a head size the tile kernel takes are tiled however long their context;
    of one it does not take (d = 40), long chunks past ROW_EXTEND_MAX go to torch and
    shorter ones per row; decode rows per row either way."""
    long_ctx = cpu_attention.ROW_EXTEND_MAX + 100
    plan, tiled = _check(
        be, [1, 2, 30, 12, 1200], [90, 40, 30, long_ctx, long_ctx + 1200], 8, 4, 64, seed=3
    )
    assert tiled == [1, 2, 3, 4] and plan.num_rows == 1 and plan.sdpa_meta is None
    plan, tiled = _check(be, [1, 12, 40], [90, 300, long_ctx], 8, 4, 40, seed=3)
    assert tiled == [] and plan.num_rows == 13
    assert plan.sdpa_meta.query_lens_cpu == [0, 0, 40]


def test_head_sizes_the_tile_kernel_does_not_take_go_per_row(be):
    plan, tiled = _check(be, [9, 1], [40, 20], 6, 2, 40, seed=4)
    assert tiled == [] and plan.num_rows == 10 and plan.sdpa_meta is None


def test_unit_ranges_cover_every_unit_once_at_about_equal_cost(be):
    plan, _ = _check(be, [600, 3], [1800, 900], 8, 4, 64, seed=6)
    n = plan.units.shape[0]
    for parts in (1, 2, 3, 7):
        ranges = plan.unit_ranges(parts)
        assert len(ranges) == min(parts, n)
        assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]]
        assert ranges[-1][1] == n
    costs = [sum(plan._costs[lo:hi]) for lo, hi in plan.unit_ranges(2)]
    assert max(costs) < 0.55 * sum(costs)


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("qlen,ctx", [(40, 41), (40, 1124), (300, 300), (17, 200)])
def test_a_continued_chunk_is_split_and_matches_the_masked_call(g, qlen, ctx):
    """A chunk that continues a prompt goes to SDPA as its prefix and its causal square,
    merged by log-sum-exp: the same values as one masked call (torch_backend's), down to
    a one-key prefix; a whole prompt keeps the single causal call."""
    gen = torch.Generator().manual_seed(g * qlen + ctx)
    hkv, d, bs = 2, 64, 16
    meta = _meta([1, qlen], [9, ctx], -(-ctx // bs) + 4, bs, gen)
    kc = torch.randn(-(-ctx // bs) + 4, bs, hkv, d, generator=gen)
    vc = torch.randn_like(kc)
    q = torch.randn(1 + qlen, g * hkv, d, generator=gen)
    sdpa_meta = replace(meta, query_lens_cpu=[0, qlen])
    starts = ref.query_starts(meta)
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    ref.extend_rows(q, kc, vc, sdpa_meta, d**-0.5, got, starts, one=cpu_attention.extend_one_split)
    ref.extend_rows(q, kc, vc, sdpa_meta, d**-0.5, want, starts)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got[0], torch.zeros_like(q[0]))  # a one-row sequence is not SDPA's
