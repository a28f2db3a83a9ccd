"""Speculative decoding is lossless: greedy outputs token-identical with and without it,
for Llama, Qwen2 and Qwen3 targets, n-gram and test proposers (all right, partly right,
always wrong), with prefix-cache hits, chunked prefill and forced preemption; seeded
sampling draws the very same tokens too."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.decoding import SpecDecoding
from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.spec_proposers import OracleProposer, WrongProposer

K = 4
MAX_TOKENS = 24
# Different lengths; some repeat themselves so that n-gram lookup finds drafts.
PROMPTS = [
    [11, 12, 13],
    [40, 41, 42, 43, 40, 41, 42, 43, 40],
    [7 + (i * 5) % 23 for i in range(17)],
    [300, 301, 302, 303, 304, 305] * 5,
    [900 + (i * 13) % 37 for i in range(45)],
]
# Engine settings of each scenario (block_size 4: drafts cross block boundaries often);
# "pressure": chunked prefill (10 tokens a step, drafts included) and a pool so small
# that requests are preempted.
SCENARIOS = {
    "plain": {"num_kv_blocks": 128},
    "pressure": {"num_kv_blocks": 20, "max_num_batched_tokens": 10},
}


def spec_llm(ckpt: Path, proposer=None, k: int = K, **engine) -> LLM:
    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    llm = LLM(str(ckpt), device="cpu", block_size=4, speculative_config=cfg, **engine)
    if proposer is not None:
        eng = llm.engine
        eng.spec = SpecDecoding.build(
            SpeculativeConfig.parse(cfg), eng.loaded, eng.runner, proposer
        )
    return llm


def tokens(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def build_target(kind: str, root: Path):
    """(checkpoint, greedy reference outputs without speculation, vocab size)."""
    ckpt = make_text_checkpoint(root, kind)
    llm = LLM(str(ckpt), device="cpu", num_kv_blocks=128)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return ckpt, tokens(llm, PROMPTS, greedy), llm.engine.loaded.text_config.vocab_size


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def target(request, tmp_path_factory):
    return build_target(request.param, tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The Llama target alone: sampling and stop rules do not depend on the architecture."""
    return build_target("llama", tmp_path_factory.mktemp("spec-llama"))


def make_proposer(kind: str, refs: list[list[int]], vocab: int):
    full = [p + r for p, r in zip(PROMPTS, refs, strict=True)]
    return {
        "ngram": None,
        "oracle": OracleProposer(full, vocab),
        # 0..K right drafts, depending on the request's length: every count occurs.
        "partial": OracleProposer(full, vocab, right=lambda n: n % (K + 1)),
        "wrong": WrongProposer(5),
    }[kind]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("kind", ["ngram", "oracle", "partial", "wrong"])
def test_greedy_identical_with_speculation(target, kind, scenario) -> None:
    ckpt, refs, vocab = target
    proposer = make_proposer(kind, refs, vocab)
    llm = spec_llm(ckpt, proposer, **SCENARIOS[scenario])
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    assert tokens(llm, PROMPTS, greedy) == refs
    # Again: now every prompt's full blocks are prefix-cache hits.
    hits = llm.engine.block_manager.prefix_hit_tokens
    assert tokens(llm, PROMPTS, greedy) == refs
    if scenario == "plain":  # under pressure the LRU may have evicted them all
        assert llm.engine.block_manager.prefix_hit_tokens > hits
    eng, stats = llm.engine, llm.engine.spec.stats
    assert stats.draft_tokens > 0
    if scenario == "pressure":
        assert eng.scheduler.num_preemptions > 0
    if kind == "oracle":
        assert stats.accepted_tokens == stats.draft_tokens
        assert stats.mean_acceptance_length > 3
    if kind == "partial":
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    if kind == "wrong":
        assert stats.accepted_tokens < stats.draft_tokens
    if isinstance(proposer, OracleProposer):  # every request's state was dropped
        assert {f"llm-{i}" for i in range(2 * len(PROMPTS))} <= set(proposer.freed)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.slow
def test_seeded_sampling_draws_the_same_tokens(llama) -> None:
    """Verification samples each position as a plain step would (same (seed, position)
    random numbers), so a seeded request's tokens do not change with speculation."""
    ckpt, refs, vocab = llama
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_k=k, seed=s, repetition_penalty=r)
        for t, k, s, r in [
            (0.8, 0, 1, 1.0),
            (1.0, 20, 2, 1.0),
            (1.3, 0, 3, 1.2),
            (0.7, 5, 4, 1.0),
            (1.0, 0, 5, 1.1),
        ]
    ]
    plain = LLM(str(ckpt), device="cpu", num_kv_blocks=128)
    want = tokens(plain, PROMPTS, params)
    for proposer in (make_proposer("partial", refs, vocab), None):
        llm = spec_llm(ckpt, proposer, num_kv_blocks=128)
        assert tokens(llm, PROMPTS, params) == want
    # Drafts proposed from the sampled outputs themselves are accepted, too.
    llm = spec_llm(
        ckpt,
        OracleProposer([p + w for p, w in zip(PROMPTS, want, strict=True)], vocab),
        num_kv_blocks=128,
    )
    assert tokens(llm, PROMPTS, params) == want
    assert llm.engine.spec.stats.accepted_tokens == llm.engine.spec.stats.draft_tokens > 0


def test_stop_max_tokens_logprobs_and_n(llama) -> None:
    """Stops inside accepted drafts truncate there; logprobs come for each emitted token."""
    ckpt, refs, vocab = llama
    plain = LLM(str(ckpt), device="cpu", num_kv_blocks=128)
    stop_at = refs[1][5]
    cases = [
        SamplingParams(max_tokens=7, temperature=0, logprobs=2),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_at]),
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0,
            min_tokens=9,
            stop_token_ids=[stop_at],
            frequency_penalty=0.5,
        ),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2),
    ]
    spec = spec_llm(ckpt, make_proposer("oracle", refs, vocab), num_kv_blocks=128)
    for params in cases:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        want, got = plain.generate(prompts, params), spec.generate(prompts, params)
        for w, g in zip(want, got, strict=True):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
            if params.logprobs:
                lw, lg = w.outputs[0].logprobs, g.outputs[0].logprobs
                assert len(lg) == len(g.outputs[0].token_ids)
                for a, b in zip(lw, lg, strict=True):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert spec.engine.spec.stats.accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "scenario"), [("eagle3", "plain"), ("peagle", "pressure")])
def test_greedy_identical_with_eagle_heads(target, kind, scenario, tmp_path) -> None:
    """Random-weight EAGLE-3 / P-EAGLE heads (Speculators layout) fed with the target's
    hidden states: low acceptance, same tokens."""
    from transformers import AutoConfig

    from tests.helpers.eagle_heads import make_eagle_head

    ckpt, refs, _ = target
    head = make_eagle_head(tmp_path, AutoConfig.from_pretrained(str(ckpt)), kind)
    cfg = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": K,
        "parallel_drafting": kind == "peagle",
    }
    llm = LLM(str(ckpt), device="cpu", block_size=4, speculative_config=cfg, **SCENARIOS[scenario])
    assert llm.engine.runner.aux_layers  # the head asked for hidden states
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    assert tokens(llm, PROMPTS, greedy) == refs
    assert tokens(llm, PROMPTS, greedy) == refs
    assert llm.engine.spec.stats.draft_tokens > 0
    if scenario == "pressure":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("over", "message"),
    [({"vocab_size": 1000, "draft_vocab": 1000}, "vocab"), ({"target_hidden_size": 32}, "hidden")],
)
def test_head_that_does_not_fit_is_refused_at_start(llama, tmp_path, over, message) -> None:
    from transformers import AutoConfig

    from tests.helpers.eagle_heads import make_eagle_head

    ckpt = llama[0]
    head = make_eagle_head(tmp_path, AutoConfig.from_pretrained(str(ckpt)), **over)
    cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt), device="cpu", num_kv_blocks=32, speculative_config=cfg)


def test_torch_backend_verifies_as_extends(llama):
    """The torch backend has no one-call step (``stack_max_rows`` 0): its verifications
    run as extends, never row by row, and stay lossless."""
    ckpt, _, _ = llama
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    plain = LLM(str(ckpt), device="cpu", num_kv_blocks=128, attention_backend="torch")
    llm = spec_llm(ckpt, num_kv_blocks=128, attention_backend="torch")
    assert tokens(llm, PROMPTS, greedy) == tokens(plain, PROMPTS, greedy)
    assert llm.engine.spec.stats.accepted_tokens > 0
