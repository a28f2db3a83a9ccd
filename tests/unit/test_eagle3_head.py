"""The EAGLE-3 / P-EAGLE head: Speculators' own checkpoints load and compute the same
logits, our saves round-trip in the Speculators layout, bad heads fail clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from services.models.checkpoint import CheckpointError
from services.models.eagle3 import Eagle3Head
from services.models.eagle3_config import DraftHeadError, Eagle3Config
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.eagle_heads import head_config, make_eagle_head

DATA = Path(__file__).parents[1] / "data" / "speculators"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = make_text_checkpoint(tmp_path_factory.mktemp("eagle"), "llama", num_hidden_layers=4)
    return AutoConfig.from_pretrained(d)


def _logits(head: Eagle3Head, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Step-0 logits over a whole sequence, positions 1.. as Speculators trains them."""
    pos = torch.arange(1, ids.shape[0] + 1)[None]
    out, _, _ = head.step(ids[None], head.fuse(hidden[None]), pos)
    return head.readout(out)[0][0]


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_a_head_saved_by_speculators_gives_speculators_logits(kind, native, request):
    # The fixture was written by speculators 0.9.0 itself (tests/data/speculators/make.py).
    # native: norms and rotary through the cpu backend, as the engine's proposer runs it.
    head = Eagle3Head.from_pretrained(DATA / kind)
    if native:
        head.use_backend(request.getfixturevalue("be"))
    ref = load_file(str(DATA / f"{kind}_reference.safetensors"))
    got = _logits(head, ref["input_ids"], ref["hidden"])
    torch.testing.assert_close(got, ref["logits"], atol=1e-5, rtol=1e-5)
    pos = torch.arange(1, ref["input_ids"].shape[0] + 1)[None]
    out, _, _ = head.step(ref["input_ids"][None], head.fuse(ref["hidden"][None]), pos)
    drafts, _ = head.greedy(out[0])  # what the proposer drafts: the argmax, in target ids
    assert torch.equal(drafts, head.to_target(ref["logits"].argmax(-1)))
    assert head.cfg.parallel == (kind == "peagle")
    assert head.cfg.aux_layers == (0, 1, 2)  # ids 1, 2, 3 = outputs of layers 0, 1, 2


def test_d2t_maps_draft_ids_to_target_ids():
    head = Eagle3Head.from_pretrained(DATA / "eagle3")
    ids = torch.arange(head.cfg.draft_vocab_size)
    mapped = head.to_target(ids)
    assert torch.equal(mapped, ids + head.d2t)
    assert head.t2d[mapped].all() and int(head.t2d.sum()) == head.cfg.draft_vocab_size


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_save_pretrained_round_trips_in_the_speculators_layout(tmp_path, target, kind):
    d = make_eagle_head(tmp_path, target, kind, draft_vocab=target.vocab_size // 2)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["speculators_model_type"] == kind
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["speculators_config"]["default_proposal_method"] == "greedy"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    head = Eagle3Head.from_pretrained(d)
    assert Eagle3Config.from_json(head.cfg.to_json()) == head.cfg
    head.save_pretrained(tmp_path / "again")
    again = Eagle3Head.from_pretrained(tmp_path / "again")
    ids, hidden = torch.randint(0, target.vocab_size, (9,)), torch.randn(9, 3 * target.hidden_size)
    assert torch.equal(_logits(head, ids, hidden), _logits(again, ids, hidden))


def test_a_head_that_fits_the_target_passes_the_check(target):
    head_config(target).check_target(target)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"target_hidden_size": 48}, "hidden size"),
        ({"vocab_size": 1000, "draft_vocab_size": 500}, "vocab size"),
        ({"aux_layer_ids": (1, 2, 9)}, "the target has 4 layers"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused(target, over, message):
    with pytest.raises(DraftHeadError, match=message):
        head_config(target, **over).check_target(target)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("speculators_model_type"), "not a Speculators head"),
        (lambda c: c.update(speculators_model_type="medusa"), "medusa"),
        (lambda c: c.update(fc_norm=True), "fc_norm"),
        (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "one-layer"),
        (lambda c: c["transformer_layer_config"].update(model_type="gemma"), "gemma"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "embeddings"),
        (lambda c: c.update(draft_vocab_size=10_000), "draft_vocab_size"),
    ],
)
def test_a_malformed_config_is_refused(tmp_path, edit, message):
    d = tmp_path / "head"
    shutil.copytree(DATA / "eagle3", d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftHeadError, match=message):
        Eagle3Head.from_pretrained(d)


def test_a_peagle_head_needs_its_mask_token(tmp_path):
    d = tmp_path / "head"
    shutil.copytree(DATA / "peagle", d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftHeadError, match="mask_token_id"):
        Eagle3Head.from_pretrained(d)


def test_missing_directory_and_missing_weights_are_clear_errors(tmp_path):
    with pytest.raises(DraftHeadError, match="does not exist"):
        Eagle3Head.from_pretrained(tmp_path / "nowhere")
    d = tmp_path / "head"
    shutil.copytree(DATA / "eagle3", d)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        Eagle3Head.from_pretrained(d)


def test_a_head_without_embeddings_takes_the_targets(tmp_path):
    head = Eagle3Head.from_pretrained(DATA / "eagle3")
    state = {n: t for n, t in head.state_dict().items() if n != "embed_tokens.weight"}
    d = tmp_path / "head"
    shutil.copytree(DATA / "eagle3", d)
    save_file({n: t.contiguous() for n, t in state.items()}, str(d / "model.safetensors"))
    with pytest.raises(DraftHeadError, match="embed_tokens"):
        Eagle3Head.from_pretrained(d)
    shared = Eagle3Head.from_pretrained(d, target_embed=head.embed_tokens.weight)
    assert torch.equal(shared.embed_tokens.weight, head.embed_tokens.weight)
