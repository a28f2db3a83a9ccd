"""Rejection sampling leaves the target's distribution unchanged: with a draft that is
deliberately wrong (always the same token), the empirical joint distribution of the
first two sampled tokens matches the target's exact one (chi-square, fixed seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.decoding import SpecDecoding
from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.reference import load_hf
from tests.helpers.spec_proposers import WrongProposer

PROMPT = [11, 12, 13, 14]
TOP_K = 4
N = 2000


def top_k_probs(model, tokens: list[int]) -> dict[int, float]:
    """The target's next-token distribution at temperature 1, top-k masked."""
    logits = model(torch.tensor([tokens])).logits[0, -1].double()
    vals, ids = logits.topk(TOP_K)
    return dict(zip(ids.tolist(), vals.softmax(-1).tolist(), strict=True))


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.slow
@torch.inference_mode()
def test_wrong_drafts_leave_the_distribution_unchanged(tmp_path) -> None:
    # A small vocabulary keeps 2000 requests' sampling cheap.
    ckpt = make_text_checkpoint(tmp_path, "llama", seed=5, vocab_size=256)
    hf = load_hf(ckpt)
    p1 = top_k_probs(hf, PROMPT)
    joint = {
        (a, b): pa * pb for a, pa in p1.items() for b, pb in top_k_probs(hf, [*PROMPT, a]).items()
    }
    # The draft: the likeliest second token after the likeliest first one, so it is
    # sometimes accepted and sometimes rejected.
    draft = max(joint, key=joint.get)[1]
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    llm = LLM(str(ckpt), device="cpu", speculative_config=cfg, num_kv_blocks=1024)
    eng = llm.engine
    eng.spec = SpecDecoding.build(cfg, eng.loaded, eng.runner, WrongProposer(draft))
    # max_tokens 3: the second token is the one verified against the draft.
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, seed=s, ignore_eos=True)
        for s in range(N)
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params)
    stats = eng.spec.stats
    assert stats.draft_tokens == N and 0 < stats.accepted_tokens < N
    counts: dict[tuple[int, int], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(joint)
    # Bins expected below 5 draws are pooled, as the test requires.
    big = [k for k in joint if joint[k] * N >= 5]
    observed = [counts.get(k, 0) for k in big] + [N - sum(counts.get(k, 0) for k in big)]
    expected = [joint[k] * N for k in big] + [N * (1 - sum(joint[k] for k in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    df = sum(e > 0 for e in expected) - 1
    assert stat < chi2_critical(df), (stat, df, observed, expected)
    # The draft's own acceptance rate is the target's probability of it.
    p_draft = sum(pj for (a, b), pj in joint.items() if b == draft)
    assert abs(stats.accepted_tokens / N - p_draft) < 4 * math.sqrt(p_draft * (1 - p_draft) / N)
