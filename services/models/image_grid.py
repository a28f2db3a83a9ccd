"""How many tokens an image takes in the prompt, and where the decoder places them, from
its header's width and height alone (no pixels, no torch: the gateway expands the
placeholders with this, before any encoder has seen the image).

A fixed-size tower (LLaVA's CLIP / SigLIP) gives every image the same count. Qwen2.5-VL
resizes each image to a multiple of its patch × merge size within a pixel budget (the
rule of transformers' ``smart_resize``, held equal to the processor's output by
tests/unit/test_image_grid.py) and gives one token per merged patch, laid out as a
(t, h, w) grid that the decoder's multimodal rotary positions follow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.models.config_json import QWEN_VL_TEXT_TYPES

# Over this aspect ratio the Qwen processor refuses an image.
MAX_ASPECT_RATIO = 200
# mm_processor_kwargs a request may set, and their bounds (pixels of the resized image).
_PIXEL_KEYS = ("min_pixels", "max_pixels")
_MAX_PIXELS_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class ImageOptions:
    """A request's processor settings that change an image's embedding
    (``mm_processor_kwargs``); 0 keeps the checkpoint's own value."""

    min_pixels: int = 0
    max_pixels: int = 0

    @classmethod
    def of(cls, kwargs: dict | None) -> ImageOptions:
        """From a request's ``mm_processor_kwargs``; ValueError names a bad key or value."""
        if not kwargs:
            return cls()
        if not isinstance(kwargs, dict):
            raise ValueError("mm_processor_kwargs must be an object")
        unknown = sorted(set(kwargs) - set(_PIXEL_KEYS))
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: unsupported keys {unknown}; supported: {list(_PIXEL_KEYS)}"
            )
        values = {}
        for key in _PIXEL_KEYS:
            v = kwargs.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= _MAX_PIXELS_LIMIT:
                raise ValueError(
                    f"mm_processor_kwargs.{key} must be an integer in [1, {_MAX_PIXELS_LIMIT}]"
                )
            values[key] = v
        opts = cls(**values)
        if opts.min_pixels and opts.max_pixels and opts.min_pixels > opts.max_pixels:
            raise ValueError("mm_processor_kwargs: min_pixels is larger than max_pixels")
        return opts

    @property
    def is_default(self) -> bool:
        return not (self.min_pixels or self.max_pixels)

    def key(self) -> str:
        """What the image's hash adds for these settings ("" for the checkpoint's own)."""
        if self.is_default:
            return ""
        return f"|min_pixels={self.min_pixels}|max_pixels={self.max_pixels}"


@dataclass(frozen=True)
class Placement:
    tokens: int  # placeholder tokens (= embedding rows)
    grid: tuple[int, ...] = ()  # (t, h, w) of those tokens, for M-RoPE; () when unused


@dataclass(frozen=True)
class FixedGrid:
    """Every image takes ``tokens`` tokens (the tower's input is a fixed square)."""

    tokens: int

    def place(self, width: int, height: int, options: ImageOptions) -> Placement:
        self.check_options(options)
        return Placement(self.tokens)

    def check_options(self, options: ImageOptions) -> None:
        if not options.is_default:
            raise ValueError("this model's image processor takes no mm_processor_kwargs")

    def check(self, length: int, grid: tuple[int, ...]) -> bool:
        """Whether a span received from elsewhere is one this model makes."""
        return length == self.tokens and not grid


@dataclass(frozen=True)
class DynamicGrid:
    """Qwen2-VL / Qwen2.5-VL: resized to multiples of ``patch * merge`` within
    [min_pixels, max_pixels]; one token per merge × merge patches."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    def place(self, width: int, height: int, options: ImageOptions) -> Placement:
        lo, hi = self.check_options(options)
        h, w = smart_resize(height, width, self.patch * self.merge, lo, hi)
        grid = (1, h // (self.patch * self.merge), w // (self.patch * self.merge))
        return Placement(grid[1] * grid[2], grid)

    def check_options(self, options: ImageOptions) -> tuple[int, int]:
        """The (min, max) pixels an image gets. A request may move either within the
        checkpoint's own budget, never past its max_pixels: a tiny image asked up to
        64 Mi pixels would cost the tower hundreds of thousands of patches."""
        lo = options.min_pixels or self.min_pixels
        hi = options.max_pixels or self.max_pixels
        if max(options.min_pixels, options.max_pixels) > self.max_pixels:
            raise ValueError(
                f"mm_processor_kwargs: pixels above the model's max_pixels {self.max_pixels}"
            )
        if lo > hi:
            raise ValueError(f"mm_processor_kwargs: min_pixels {lo} is larger than max_pixels {hi}")
        return lo, hi

    def check(self, length: int, grid: tuple[int, ...]) -> bool:
        """One frame (t = 1, as for every image) whose merged patches are ``length``."""
        return len(grid) == 3 and grid[0] == 1 and min(grid) > 0 and grid[1] * grid[2] == length


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) both multiples of ``factor``, area within [min, max] pixels, the
    aspect ratio kept as nearly as rounding allows (the Qwen2-VL processor's rule)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {width}x{height} is over {MAX_ASPECT_RATIO}:1, "
            "which this model's processor refuses"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


ImageGrid = FixedGrid | DynamicGrid


def read_grid(model_dir: Path, model_type: str, tokens_per_image: int) -> ImageGrid:
    """The checkpoint's rule, from its processor's saved JSON (``preprocessor_config.json``
    or the ``image_processor`` inside ``processor_config.json``)."""
    if model_type not in QWEN_VL_TEXT_TYPES:
        return FixedGrid(tokens_per_image)
    proc = _processor_json(model_dir)
    size = proc.get("size") or {}
    lo = proc.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    hi = proc.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    return DynamicGrid(int(proc.get("patch_size", 14)), int(proc.get("merge_size", 2)), lo, hi)


def _processor_json(model_dir: Path) -> dict:
    path = model_dir / "preprocessor_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        return json.loads(nested.read_text()).get("image_processor") or {}
    return {}
