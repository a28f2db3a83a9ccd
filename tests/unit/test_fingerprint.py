"""The model fingerprint covers the weights' content: two checkpoints of one shape with
different weights differ (two fine-tunes must not share cache keys or encode subjects);
the same checkpoint copied elsewhere does not; a digest is computed once per file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from services.config import EngineConfig
from services.models.fingerprint import checkpoint_fingerprint, file_digest
from services.models.info import ModelInfo
from tests.helpers.checkpoints import make_text_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return make_text_checkpoint(root, "llama", seed=0), make_text_checkpoint(root, "llama", seed=1)


def test_other_weights_of_one_shape_get_another_fingerprint(checkpoints, tmp_path):
    a, b = checkpoints
    # The old fingerprint's inputs are equal: configs and file names and sizes.
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert [(f.name, f.stat().st_size) for f in sorted(a.glob("*.safetensors"))] == [
        (f.name, f.stat().st_size) for f in sorted(b.glob("*.safetensors"))
    ]
    assert checkpoint_fingerprint(a, cache_dir=tmp_path) != checkpoint_fingerprint(
        b, cache_dir=tmp_path
    )


def test_a_copy_elsewhere_gets_the_same_fingerprint(checkpoints, tmp_path):
    a, _ = checkpoints
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "renamed")
    assert checkpoint_fingerprint(copy, cache_dir=tmp_path / "c1") == checkpoint_fingerprint(
        a, cache_dir=tmp_path / "c2"
    )


def test_one_changed_tensor_changes_the_fingerprint(checkpoints, tmp_path):
    """A fine-tune that touched only one small tensor (a norm's weights) is caught by
    the per-tensor samples, not only by luck of the evenly spaced blocks."""
    from safetensors.torch import load_file, save_file

    a, _ = checkpoints
    copy = Path(shutil.copytree(a, tmp_path / "tuned"))
    weights = load_file(str(copy / "model.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("input_layernorm.weight"))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    original = checkpoint_fingerprint(a, cache_dir=tmp_path / "c")
    assert checkpoint_fingerprint(copy, cache_dir=tmp_path / "c") != original


def test_digest_is_cached_by_path_size_and_mtime(checkpoints, tmp_path):
    a, _ = checkpoints
    copy = Path(shutil.copytree(a, tmp_path / "ckpt"))
    f = copy / "model.safetensors"
    first = file_digest(f, tmp_path / "cache")
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and entries[0].read_text() == first
    # A planted entry is what a second call returns: the file was not read again.
    entries[0].write_text("planted")
    assert file_digest(f, tmp_path / "cache") == "planted"
    # Touched (new mtime): the entry no longer applies.
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert file_digest(f, tmp_path / "cache") == first


def test_not_a_safetensors_file_is_refused(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        file_digest(bad, tmp_path / "cache")


def test_model_info_uses_the_content_fingerprint(checkpoints):
    a, b = checkpoints
    fa = ModelInfo.load(EngineConfig(model=str(a))).fingerprint
    fb = ModelInfo.load(EngineConfig(model=str(b))).fingerprint
    assert fa != fb and len(fa) == 16
    dummy = ModelInfo.load(EngineConfig(model=str(a), load_format="dummy")).fingerprint
    assert dummy != fa  # random weights are another model
