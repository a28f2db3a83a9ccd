"""Nemotron-H (Mamba-2, attention, MLP and MoE layers in one stack) against transformers:
greedy tokens identical and top-5 logprobs within 1e-3 on every backend, through chunked
prefill (the recurrent state carried across chunks), preemption by recompute (the state
rebuilt), multi-step bursts and the older ``hybrid_override_pattern`` config; the state
slots' accounting; the parts (scan, MoE block) against their references; and every
refusal: unknown layer kinds, experts that do not match the weights, speculative
decoding. The fleet's hand-off of the state is in tests/integration/test_moe_fleet.py."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch

from services import LLM, SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.kernels.torch_backend import TorchBackend
from services.models.loader import CheckpointError
from services.models.mamba2 import Mamba2Mixer
from services.models.nemotron_h import NemotronHMoE
from services.sampling_params import SamplingParams as SP
from tests.helpers.checkpoints import NEMOTRON_H_LAYERS, _text_config, make_text_checkpoint
from tests.helpers.reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

MAX_NEW = 12


def _prompts(n: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, 30000) for _ in range(lengths[i % len(lengths)])] for i in range(n)
    ]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("nemotron"), "nemotron_h")


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


def _check(outs, refs) -> None:
    for out, (ids, top) in zip(outs, refs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ids
        for ours, theirs in zip(comp.logprobs, top, strict=False):
            for tid, lp in theirs:
                assert abs(ours[tid].logprob - lp) < 1e-3


def _run(llm, prompts, **sp):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, **sp)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_matches_transformers(backend, ckpt, hf, caplog):
    prompts = _prompts(4, (5, 17, 33, 50), seed=0)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    with caplog.at_level(logging.INFO, logger="services.engine.llm_engine"):
        llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256, attention_backend=backend)
    assert "prefix caching is off" in caplog.text
    _check(_run(llm, prompts, logprobs=5), refs)
    # Again: nothing comes from a prefix cache, and the states start from zero again.
    again = _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in again] == [ids for ids, _ in refs]
    assert sum(o.num_cached_tokens for o in again) == 0
    # Bursts of 4 decode steps after the prefill, alone and in a batch.
    llm.engine.config.num_scheduler_steps = 4
    for batch in (prompts[:1], prompts):
        burst = _run(llm, batch)
        assert [o.outputs[0].token_ids for o in burst] == [ids for ids, _ in refs[: len(batch)]]


def test_one_thread_decode(ckpt, hf, one_thread):
    prompts = _prompts(2, (9, 21), seed=1)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    _check(_run(LLM(str(ckpt), block_size=4, num_kv_blocks=128), prompts, logprobs=5), refs)


def test_chunked_prefill_carries_the_state(ckpt, hf):
    prompts = _prompts(3, (40, 23, 11), seed=2)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256, max_num_batched_tokens=7)
    _check(_run(llm, prompts, logprobs=5), refs)


def test_preemption_rebuilds_the_state(ckpt, hf):
    prompts = _prompts(6, (20, 31, 9, 26), seed=5)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=24, max_num_seqs=4)
    _check(_run(llm, prompts, logprobs=5), refs)
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == 24 and len(bm._free_slots) == 4


def test_the_older_pattern_config_loads_the_same_model(ckpt, tmp_path):
    old = tmp_path / "pattern"
    shutil.copytree(ckpt, old)
    cfg = json.loads((old / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    cfg["hybrid_override_pattern"] = "".join(letters[k] for k in cfg.pop("layers_block_type"))
    (old / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(2, (13, 30), seed=6)
    want = [o.outputs[0].token_ids for o in _run(LLM(str(ckpt), num_kv_blocks=64), prompts)]
    got = [o.outputs[0].token_ids for o in _run(LLM(str(old), num_kv_blocks=64), prompts)]
    assert got == want


def _edit_config(ckpt, tmp_path, **changes):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text()) | changes
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_an_unknown_layer_kind_is_refused_at_load(ckpt, tmp_path):
    bad = _edit_config(ckpt, tmp_path, layers_block_type=[*NEMOTRON_H_LAYERS[:-1], "conv"])
    with pytest.raises(CheckpointError, match="layer kinds we do not run: \\['conv'\\]"):
        LLM(str(bad))


def test_experts_that_do_not_match_the_weights_are_refused_at_load(ckpt, tmp_path):
    bad = _edit_config(ckpt, tmp_path, n_routed_experts=6)
    with pytest.raises(CheckpointError, match="expert|shape"):
        LLM(str(bad))


def test_speculative_decoding_is_refused_at_start(ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="not supported for hybrid"):
        LLM(str(ckpt), speculative_config=spec)


def test_a_prompt_longer_than_the_context_is_refused(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError):
        _run(llm, _prompts(1, (40,), seed=7))
    assert [len(o.outputs[0].token_ids) for o in _run(llm, _prompts(1, (8,), seed=7))] == [12]


def test_the_moe_layer_is_transformers_block():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE as Theirs

    cfg = _text_config("nemotron_h", 100, _Tok())
    torch.manual_seed(0)
    theirs = Theirs(cfg).eval()
    for p in theirs.parameters():
        p.data.normal_(0, 0.3)
    theirs.gate.e_score_correction_bias.normal_(0, 0.05)
    ours = NemotronHMoE(cfg, TorchBackend())
    ours.up.data.copy_(theirs.experts.up_proj)
    ours.down.data.copy_(theirs.experts.down_proj)
    rest = {k: v for k, v in theirs.state_dict().items() if not k.startswith("experts.")}
    result = ours.load_state_dict(rest, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) == {"up", "down"}
    h = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(h), theirs(h[None])[0], rtol=1e-4, atol=1e-4)
        experts, _ = ours.route(h)
    assert len({tuple(sorted(p)) for p in experts.tolist()}) >= 6  # routing differs per token


class _Tok:
    cls_token_id, sep_token_id, pad_token_id = 1, 2, 0


def test_chunked_scan_equals_recurrent_steps():
    """A prompt run as one query, as queries of 5, and token by token: same outputs and
    final state (the chunk scan and the recurrent step are the same recurrence)."""
    cfg = _text_config("nemotron_h", 100, _Tok())
    torch.manual_seed(1)
    mixer = Mamba2Mixer(cfg, TorchBackend())
    for p in mixer.parameters():
        p.data.normal_(0, 0.3)
    conv_shape, ssm_shape = mixer.state_shapes()
    h = torch.randn(21, cfg.hidden_size)

    def run(split: list[int]):
        state = (torch.zeros(1, *conv_shape), torch.zeros(1, *ssm_shape))
        slot = torch.zeros(1, dtype=torch.long)
        outs, start = [], 0
        for n in split:
            outs.append(mixer(h[start : start + n], state, [n], slot))
            start += n
        return torch.cat(outs), state

    with torch.no_grad():
        whole, whole_state = run([21])
        for split in ([5, 5, 5, 5, 1], [1] * 21):
            out, state = run(split)
            torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-4)
            for a, b in zip(state, whole_state, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_state_slots_are_held_with_the_blocks():
    bm = BlockManager(64, 4, enable_prefix_caching=False, num_state_slots=2)
    reqs = [Request(f"r{i}", [5] * 6, SP()) for i in range(3)]
    assert bm.allocate_slots(reqs[0], 6, []) and bm.allocate_slots(reqs[1], 6, [])
    assert {r.state_slot for r in reqs[:2]} == {0, 1}
    assert not bm.allocate_slots(reqs[2], 6, [])  # blocks to spare, but no slot
    assert reqs[2].block_ids == [] and reqs[2].state_slot is None
    assert bm.allocate_slots(reqs[0], 4)  # growing keeps its slot
    bm.free(reqs[1])
    assert reqs[1].state_slot is None and bm.allocate_slots(reqs[2], 6, [])
    assert reqs[2].state_slot == 1
    assert bm.allocate_for_import(Request("imp", [], SP()), 8) is None  # no slot left
