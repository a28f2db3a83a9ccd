"""The engine's side of the Proposer contract: the aux hidden rows a draft head gets are
the outputs of the layers it names (checked against transformers' hidden_states), at the
positions just before each request's newest token, each position once (accumulated over
prefill chunks; only accepted positions after a verification), again after preemption."""

from __future__ import annotations

import pytest
import torch

from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.decoding import SpecDecoding
from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.reference import load_hf
from tests.helpers.spec_proposers import OracleProposer

PROMPTS = [[11, 12, 13], [7 + (i * 5) % 23 for i in range(17)], [40, 41, 42, 43] * 6]
MAX_TOKENS = 16
LAYERS = (1, 0)  # any order: the rows concatenate in the order asked for


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(
        tmp_path_factory.mktemp("aux"), "llama", seed=3, num_hidden_layers=3
    )


def run(ckpt, right, **engine) -> tuple[OracleProposer, list[list[int]], LLM]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    plain = LLM(str(ckpt), device="cpu", num_kv_blocks=128)
    refs = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    ]
    full = [p + r for p, r in zip(PROMPTS, refs, strict=True)]
    vocab = plain.engine.loaded.text_config.vocab_size
    oracle = OracleProposer(full, vocab, right=right, aux_layers=LAYERS)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    llm = LLM(str(ckpt), device="cpu", block_size=4, speculative_config=cfg, **engine)
    eng = llm.engine
    eng.spec = SpecDecoding.build(cfg, eng.loaded, eng.runner, oracle)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    ]
    assert got == refs
    return oracle, full, llm


@torch.inference_mode()
def hf_layer_outputs(ckpt, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), len(LAYERS) * H]: transformers' outputs of LAYERS (hidden_states
    i + 1 is layer i's output, for every layer but the last, which is normed)."""
    out = load_hf(ckpt)(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


@pytest.mark.parametrize(
    ("right", "engine"),
    [
        (None, {"num_kv_blocks": 128}),
        (lambda n: n % 4, {"num_kv_blocks": 128, "max_num_batched_tokens": 7}),
    ],
    ids=["all-accepted", "partial-chunked"],
)
def test_rows_are_the_named_layers_outputs_each_position_once(ckpt, right, engine) -> None:
    oracle, full, _ = run(ckpt, right, **engine)
    for i, seq in enumerate(full):
        blocks = oracle.hidden[f"llm-{i}"]
        positions = [first + j for first, rows in blocks for j in range(rows.shape[0])]
        # Every position from 0 on, once, up to the one before the last proposal's token.
        assert positions == list(range(len(positions))) and len(positions) >= len(PROMPTS[i])
        rows = torch.cat([rows for _, rows in blocks])
        ref = hf_layer_outputs(ckpt, seq)[: len(positions)]
        assert rows.shape == ref.shape
        torch.testing.assert_close(rows, ref, atol=2e-4, rtol=1e-4)


def test_rows_delivered_again_after_preemption(ckpt) -> None:
    oracle, full, llm = run(ckpt, None, num_kv_blocks=10, max_num_batched_tokens=32)
    assert llm.engine.scheduler.num_preemptions > 0
    restarted = 0
    for rid, blocks in oracle.hidden.items():
        events = [(kind, first) for kind, r, first in oracle.events if r == rid]
        assert events[-1] == ("free", -1) and events.count(("free", -1)) >= 1
        # Rows after a free (a preemption): where the recompute starts, position 0 or
        # the end of a prefix-cache hit (a block boundary).
        restarts = [
            nxt[1] for (kind, _), nxt in zip(events, events[1:], strict=False) if kind == "free"
        ]
        assert all(first % 4 == 0 for first in restarts)
        restarted += len(restarts)
        ref = hf_layer_outputs(ckpt, full[int(rid.split("-")[1])])
        for first, rows in blocks:  # recomputed rows are right too
            torch.testing.assert_close(
                rows, ref[first : first + rows.shape[0]], atol=2e-4, rtol=1e-4
            )
    assert restarted > 0
