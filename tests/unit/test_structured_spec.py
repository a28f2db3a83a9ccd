"""Structured outputs under speculative decoding: drafts are checked against the
grammar (cut at the first it refuses), the verification's rows are masked along the
drafts and the matcher advances over what was accepted only; the grammar's forced
tokens are drafted themselves (jump-forward: always accepted). The tokens are the very
same as without speculation, greedy and seeded, with proposers right, wrong or n-gram."""

from __future__ import annotations

import json

import pytest

from services import LLM, SamplingParams
from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.decoding import SpecDecoding
from tests.helpers.checkpoints import make_byte_bpe_checkpoint
from tests.helpers.schemas import RECORD
from tests.helpers.spec_proposers import OracleProposer, RecordingProposer, WrongProposer

SCHEMA = RECORD
ASKS = [{"json": SCHEMA}, {"regex": r"[a-c]{3}-[0-9]{2}"}, None]
PROMPTS = ["first", "second one", "the third"]


def _params(**kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=60, structured_outputs=a, **kw) for a in ASKS]


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def ckpt(tiny_root):
    return make_byte_bpe_checkpoint(tiny_root)


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256)
    greedy = _tokens(llm, _params(temperature=0.0))
    sampled = _tokens(llm, _params(temperature=0.9, seed=5))
    return greedy, sampled


def _spec_llm(ckpt, proposer=None) -> LLM:
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256, speculative_config=cfg)
    if proposer is not None:
        eng = llm.engine
        eng.spec = SpecDecoding.build(
            SpeculativeConfig.parse(cfg), eng.loaded, eng.runner, proposer
        )
    return llm


@pytest.mark.parametrize("proposer", ["ngram", "oracle", "wrong"])
def test_speculation_under_a_grammar_changes_no_token(ckpt, reference, proposer):
    greedy, sampled = reference
    if proposer == "oracle":
        llm0 = LLM(str(ckpt), block_size=4, num_kv_blocks=256)
        ids = [llm0.tokenizer.encode(p) for p in PROMPTS]
        refs = [p + g for p, g in zip(ids, greedy, strict=True)]
        spec = _spec_llm(ckpt, OracleProposer(refs, len(llm0.tokenizer)))
    else:
        spec = _spec_llm(ckpt, WrongProposer(7) if proposer == "wrong" else None)
    assert _tokens(spec, _params(temperature=0.0)) == greedy
    assert _tokens(spec, _params(temperature=0.9, seed=5)) == sampled
    stats = spec.engine.spec.stats
    assert stats.draft_tokens > 0  # forced tokens at least were drafted
    if proposer == "oracle":
        assert stats.acceptance_rate > 0.9


def test_forced_tokens_are_drafted_and_accepted(ckpt, reference):
    """With a proposer that proposes nothing, the drafts are the grammar's forced tokens
    (a JSON key after `{`, say): every one of them is accepted."""
    spec = _spec_llm(ckpt, RecordingProposer(()))
    (out,) = spec.generate(
        ["x"], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA})
    )
    assert set(json.loads(out.outputs[0].text)) == {"name", "n", "color"}
    stats = spec.engine.spec.stats
    assert stats.draft_tokens > 5 and stats.accepted_tokens == stats.draft_tokens
