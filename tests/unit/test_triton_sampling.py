"""The Triton sampler: exact greedy, batch-order invariance, masks, and its distribution.

Triton and torch samplers draw different (but equally valid) tokens from the same seed:
both key their noise on ``mix_seed(seed, position)`` only, so each is compared with the
twin's mask and with softmax(logits / T) by a chi-square test, not token by token.
"""

import pytest
import torch
import triton
import triton.language as tl

from services.kernels import torch_backend as ref
from services.kernels.metadata import SamplingTensors
from services.kernels.triton_sampling import mix_seed, sample

pytestmark = pytest.mark.triton
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tensors(
    b: int, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, positions=None
) -> SamplingTensors:
    """Per-row controls; scalars broadcast to every row, lists give one value per row."""

    def col(x, dtype):
        return (
            torch.tensor(x, dtype=dtype)
            if isinstance(x, list)
            else torch.full((b,), x, dtype=dtype)
        ).to(DEV)

    t = SamplingTensors(
        temperature=col(temp, torch.float32),
        top_k=col(top_k, torch.int32),
        top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32),
        seeds=col(seed, torch.int64),
        positions=torch.arange(b, device=DEV) if positions is None else col(positions, torch.int64),
        all_greedy=False,
        no_top_k=False,
        no_top_p=False,
        no_min_p=False,
    )
    t.all_greedy = bool((t.temperature == 0).all())
    t.no_top_k, t.no_top_p = bool((t.top_k == 0).all()), bool((t.top_p >= 1).all())
    t.no_min_p = bool((t.min_p == 0).all())
    return t


def take(t: SamplingTensors, idx: torch.Tensor) -> SamplingTensors:
    """The rows ``idx`` of t (flags kept: they only enable work)."""
    fields = ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")
    kw = {f: getattr(t, f)[idx] for f in fields}
    return SamplingTensors(
        **kw, all_greedy=t.all_greedy, no_top_k=t.no_top_k, no_top_p=t.no_top_p, no_min_p=t.no_min_p
    )


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the cells with non-zero probability."""
    n = counts.sum()
    live = probs > 0
    expected = probs[live].double() * n
    stat = ((counts[live].double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(live.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


@triton.jit
def _mix_kernel(seed_ptr, pos_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, mix_seed(tl.load(seed_ptr + offs), tl.load(pos_ptr + offs)))


def test_in_kernel_seed_mix_equals_host_mix() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 5, 987654321], device=DEV)
    pos = torch.tensor([0, 7, 3, 2**40], device=DEV)
    out = torch.empty(4, dtype=torch.int64, device=DEV)
    _mix_kernel[(1,)](seeds, pos, out, BLOCK=4)
    assert out.tolist() == [
        ref.mix_seed(s, p) for s, p in zip(seeds.tolist(), pos.tolist(), strict=True)
    ]


def test_greedy_rows_are_argmax_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 3000, generator=gen).to(DEV)  # two 2048-wide chunks
    logits[1, 2500] = logits[1, 40] = 100.0  # tie across chunks: the first index wins
    logits[2, 7] = logits[2, 8] = 100.0  # tie inside a chunk
    t = tensors(8, temp=[0.0, 0.0, 0.0, 1.0, 0.0, 0.7, 0.0, 2.0], top_k=[0, 5, 0, 5, 0, 0, 3, 0])
    got = sample(logits, t)
    greedy = t.temperature == 0
    assert torch.equal(got[greedy], logits.argmax(-1)[greedy])
    assert got[1] == 40 and got[2] == 7
    all_greedy = tensors(8, temp=0.0)
    assert torch.equal(sample(logits, all_greedy), logits.argmax(-1))


def test_same_seed_and_position_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    b, v = 12, 300
    logits = torch.randn(b, v, generator=gen).to(DEV) * 3
    t = tensors(
        b,
        temp=[1.0, 0.5, 1.5, 0.0] * 3,
        top_k=[0, 10, 0, 0, 50, 0, 0, 3, 0, 0, 0, 7],
        top_p=[1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.95, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0],
        seed=[11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16],
        positions=[3, 3, 5, 5, 9, 9, 0, 1, 2, 3, 4, 5],
    )
    base = sample(logits, t)
    perm = torch.randperm(b, generator=gen).to(DEV)
    assert torch.equal(sample(logits[perm], take(t, perm)), base[perm])
    for i in (0, 4, 9):  # alone in its batch (another BLOCK_B, too)
        idx = torch.tensor([i], device=DEV)
        assert torch.equal(sample(logits[idx], take(t, idx)), base[idx])


@pytest.mark.parametrize(
    "controls",
    [{"top_k": 5}, {"top_p": 0.6}, {"min_p": 0.3}, {"top_k": 8, "top_p": 0.7, "min_p": 0.05}],
)
def test_masked_tokens_are_never_drawn(controls: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    b, v = 1000, 40
    logits = (torch.randn(1, v, generator=gen) * 2).expand(b, v).contiguous().to(DEV)
    t = tensors(b, temp=0.9, **controls)
    allowed = torch.isfinite(ref.mask_logits(logits[:1], take(t, torch.tensor([0], device=DEV))))[0]
    drawn = torch.bincount(sample(logits, t), minlength=v)
    assert drawn[~allowed].sum() == 0
    assert (drawn[allowed] > 0).sum() == allowed.sum()  # every allowed token shows up


def test_every_row_is_masked_by_its_own_top_k() -> None:
    gen = torch.Generator().manual_seed(4)
    b, v = 64, 50
    logits = torch.randn(b, v, generator=gen).to(DEV)
    k = torch.randint(1, 6, (b,), generator=gen).tolist()
    t = tensors(b, temp=1.0, top_k=k)
    allowed = torch.isfinite(ref.mask_logits(logits, t))
    got = sample(logits, t)
    assert allowed.gather(1, got[:, None]).all()


LOGITS = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.2, 1.1, -2.0])


@pytest.mark.parametrize("sampler", [sample, ref.sample], ids=["triton", "torch"])
def test_draws_follow_softmax_of_logits_over_temperature(sampler) -> None:
    n, temp = 20_000, 0.8
    logits = LOGITS.expand(n, -1).contiguous().to(DEV)
    t = tensors(n, temp=temp, seed=2024)
    counts = torch.bincount(sampler(logits, t).cpu(), minlength=LOGITS.numel())
    assert chi_square_pvalue(counts, torch.softmax(LOGITS / temp, -1)) > 1e-3


def test_masked_draws_follow_renormalised_softmax() -> None:
    n = 20_000
    logits = LOGITS.expand(n, -1).contiguous().to(DEV)
    t = tensors(n, temp=1.3, top_k=7, top_p=0.85, seed=99)
    want = torch.softmax(ref.mask_logits(logits[:1], take(t, torch.tensor([0], device=DEV))), -1)[
        0
    ].cpu()
    counts = torch.bincount(sample(logits, t).cpu(), minlength=LOGITS.numel())
    assert counts[want == 0].sum() == 0
    assert chi_square_pvalue(counts, want) > 1e-3


def test_empty_batch() -> None:
    assert sample(torch.empty(0, 10, device=DEV), tensors(0)).shape == (0,)
