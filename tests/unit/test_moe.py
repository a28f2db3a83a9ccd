"""The mixture-of-experts layer against transformers' own block, and its promises: the
router picks different experts for different tokens, a step runs each chosen expert
once (at batch 1, the k chosen ones only), and a checkpoint whose experts do not match
its config fails at load. Whole-model parity is in test_models_vs_transformers.py."""

from __future__ import annotations

import json

import pytest
import torch

from services import LLM
from services.kernels.torch_backend import TorchBackend
from services.models.loader import CheckpointError
from services.models.moe import MoEMLP
from tests.helpers.checkpoints import make_text_checkpoint


def _pair(kind: str):
    """Our MoEMLP and transformers' sparse block with the same random weights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            hidden_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=False,
        )
        theirs, n, inter, norm = Qwen3MoeSparseMoeBlock(cfg), 8, 16, False
    else:
        cfg = MixtralConfig(
            hidden_size=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16
        )
        theirs, n, inter, norm = MixtralSparseMoeBlock(cfg), 8, 16, True
    for p in theirs.parameters():
        p.data.normal_(0, 0.3)
    ours = MoEMLP(cfg, TorchBackend(), n, inter, norm)
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.gate_up.data.copy_(theirs.experts.gate_up_proj)
    ours.down.data.copy_(theirs.experts.down_proj)
    return ours, theirs.eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_layer_is_transformers_block(kind):
    ours, theirs = _pair(kind)
    h = torch.randn(64, 32)
    with torch.no_grad():
        want = theirs(h[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        got = ours(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    picks = torch.topk(ours.gate(h), 2, dim=-1).indices.sort(dim=-1).values
    assert len({tuple(p) for p in picks.tolist()}) >= 8  # routing differs per token


def test_each_chosen_expert_runs_once_and_only_the_chosen_ones(monkeypatch):
    ours, _ = _pair("mixtral")
    calls = []
    linear = ours.backend.linear
    monkeypatch.setattr(
        ours.backend, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or linear(x, w, b)
    )
    with torch.no_grad():
        ours(torch.randn(1, 32))
    assert len(calls) == 1 + 2 * 2  # the router, then gate_up and down of 2 experts
    calls.clear()
    with torch.no_grad():
        ours(torch.randn(256, 32))
    assert len(calls) <= 1 + 2 * 8 and sum(calls[1::2]) == 256 * 2  # each (token, slot) once


def test_an_expert_count_that_does_not_match_the_weights_fails_at_load(tmp_path):
    ckpt = make_text_checkpoint(tmp_path, "mixtral")
    cfg = json.loads((ckpt / "config.json").read_text())
    for experts, match in ((4, "unexpected weight"), (12, "shape mismatch.*gate")):
        bad = tmp_path / f"bad-{experts}"
        bad.mkdir()
        for f in ckpt.iterdir():
            (bad / f.name).symlink_to(f)
        (bad / "config.json").unlink()
        (bad / "config.json").write_text(json.dumps({**cfg, "num_local_experts": experts}))
        with pytest.raises(CheckpointError, match=match):
            LLM(str(bad), num_kv_blocks=16)


def test_a_missing_expert_weight_fails_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = make_text_checkpoint(tmp_path, "mixtral")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).symlink_to(f)
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layer 0: expert weights missing.*down\.3"):
        LLM(str(bad), num_kv_blocks=16)
