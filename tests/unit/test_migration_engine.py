"""Request migration in the engine: a request resumed from the tokens its client already
has (prefill again, KV of prompt + output handed to decode) continues exactly as if
nothing had happened, and KV reservations never leak blocks."""

from __future__ import annotations

import pytest

from services import SamplingParams
from services.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.helpers.checkpoints import make_text_checkpoint

PROMPT = [1000 + 7 * j for j in range(18)]
BLOCKS = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


def _engine(ckpt) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=BLOCKS))


def _run(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _hand_off(prefill: LLMEngine, rid: str):
    """Run the prefill-role request; its first (new) token and exported KV."""
    for out in iter(prefill.step, None):
        for o in out:
            if o.request_id == rid:
                assert o.outputs[0].token_ids_delta and o.kv_blocks is not None
                return o.outputs[0].token_ids_delta[0], o.kv_blocks
    raise AssertionError("no hand-off")


PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, repetition_penalty=1.3
    ),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 6, 13])
def test_migrated_request_continues_the_undisturbed_tokens(ckpt, params, cut):
    ref = _engine(ckpt)
    ref.add_request("r", {"prompt_token_ids": PROMPT}, params)
    expected = _run(ref)["r"]
    # The client got `cut` tokens before its decode instance died; prefill resumes.
    prefill, decode = _engine(ckpt), _engine(ckpt)
    done = expected[:cut]
    prefill.add_request("r", {"prompt_token_ids": PROMPT}, params, export_kv=True, resume=done)
    first, kv = _hand_off(prefill, "r")
    assert first == expected[cut]
    assert kv.shape[2] == -(-(len(PROMPT) + cut) // 4)
    decode.import_request("r", PROMPT + done, len(PROMPT), first, params, kv)
    assert _run(decode)["r"] == expected
    assert decode.block_manager.num_free_blocks == BLOCKS


def test_resumed_outputs_are_not_sent_again(ckpt):
    eng = _engine(ckpt)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("r", {"prompt_token_ids": PROMPT}, params, resume=[5, 6, 7])
    deltas = [o.outputs[0].token_ids_delta for o in sum(iter(eng.step, []), [])]
    assert sum(len(d) for d in deltas) == 3  # max_tokens counts the resumed three


def test_reservation_refuses_without_room_and_release_frees(ckpt):
    eng = _engine(ckpt)
    assert not eng.reserve_import("big", BLOCKS * 4 + 1)
    assert eng.block_manager.num_free_blocks == BLOCKS
    assert eng.reserve_import("a", 10)
    assert eng.block_manager.num_free_blocks == BLOCKS - 3
    with pytest.raises(ValueError, match="duplicate"):
        eng.reserve_import("a", 10)
    eng.abort_request("a")  # an aborted transfer gives its blocks back
    assert eng.block_manager.num_free_blocks == BLOCKS


def test_failed_import_frees_its_reserved_blocks(ckpt):
    import torch

    eng = _engine(ckpt)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert eng.reserve_import("r", len(PROMPT))
    bad = torch.zeros(2, 1, 5, 4, 1, 1)  # wrong layout: refused after reservation
    with pytest.raises(ValueError, match="shape"):
        eng.import_request("r", PROMPT, len(PROMPT), 3, params, bad)
    assert eng.block_manager.num_free_blocks == BLOCKS
    assert not eng.has_unfinished_requests()
