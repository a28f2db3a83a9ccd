"""The torch-free image-token rule (what the gateway expands placeholders with) agrees
with transformers' Qwen2-VL image processor on every size and pixel budget, and request
options are checked."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from services.models.image_grid import (
    DynamicGrid,
    FixedGrid,
    ImageOptions,
    read_grid,
)
from tests.helpers.checkpoints import make_qwen2_5_vl_checkpoint, make_qwen3_vl_checkpoint


def _sizes(n=60, seed=0):
    rng = random.Random(seed)
    fixed = [(1, 1), (28, 28), (27, 29), (1000, 5), (5, 999), (1280, 960), (3000, 2000)]
    return fixed + [(rng.randrange(1, 2000), rng.randrange(1, 2000)) for _ in range(n)]


@pytest.mark.parametrize(
    "patch, budget",
    [(14, (3136, 12845056)), (14, (1568, 18816)), (14, (784, 784 * 6)), (16, (65536, 16777216))],
)
def test_dynamic_grid_is_the_processors(patch, budget):
    """Qwen2.5-VL's 14-pixel patches and Qwen3-VL's 16 (with its default budget)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    lo, hi = budget
    proc = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi, patch_size=patch)
    grid = DynamicGrid(patch, 2, lo, hi)
    for w, h in _sizes():
        if max(w, h) / min(w, h) > 200:
            with pytest.raises(ValueError, match="aspect ratio"):
                grid.place(w, h, ImageOptions())
            continue
        thw = proc(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"]
        t, gh, gw = thw[0].tolist()
        placed = grid.place(w, h, ImageOptions())
        assert placed.grid == (t, gh // 2, gw // 2), (w, h)
        assert placed.tokens == t * gh * gw // 4


def test_request_options_override_the_checkpoints_budget():
    grid = DynamicGrid(14, 2, 3136, 12845056)
    full = grid.place(1280, 960, ImageOptions())
    small = grid.place(1280, 960, ImageOptions.of({"max_pixels": 28 * 28 * 64}))
    assert small.tokens <= 64 < full.tokens
    assert ImageOptions.of({"max_pixels": 50000}).key() != ImageOptions().key() == ""


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_pixels": 0}, "integer"),
        ({"max_pixels": "big"}, "integer"),
        ({"min_pixels": True}, "integer"),
        ({"min_pixels": 5000, "max_pixels": 100}, "larger"),
        ({"do_pan_and_scan": True}, "unsupported keys"),
        ([1, 2], "object"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageOptions.of(kwargs)


def test_fixed_grid_takes_no_options():
    grid = FixedGrid(49)
    assert grid.place(640, 480, ImageOptions()).tokens == 49
    with pytest.raises(ValueError, match="no mm_processor_kwargs"):
        grid.place(640, 480, ImageOptions(max_pixels=1000))
    assert grid.check(49, ()) and not grid.check(48, ())


def test_checkpoint_budget_is_read_from_its_processor(tmp_path):
    path = make_qwen2_5_vl_checkpoint(tmp_path, min_pixels=1568, max_pixels=18816)
    assert read_grid(path, "qwen2_5_vl", 0) == DynamicGrid(14, 2, 1568, 18816)
    path = make_qwen3_vl_checkpoint(tmp_path)
    assert read_grid(path, "qwen3_vl", 0) == DynamicGrid(16, 2, 2048, 24576)
    # An earlier checkpoint's flat keys.
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "preprocessor_config.json").write_text(
        '{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}'
    )
    assert read_grid(flat, "qwen2_5_vl", 0) == DynamicGrid(14, 2, 3136, 12845056)
