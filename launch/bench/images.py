"""The ``random-mm`` dataset: chat requests with 1-N generated images, some of them repeats.

Images are random pixels from the seed (no downloads), encoded with PIL as PNG or JPEG data
URLs in OpenAI ``image_url`` content parts. Each image slot is, with probability
``repeat_ratio``, an image already sent earlier in the run (drawn uniformly from those),
else a fresh one; so a server's image (embedding) cache sees a known share of repeats.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from launch.bench.datasets import WORDS, BenchRequest, draw_length

FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}


@dataclass(frozen=True)
class ImageOptions:
    """How ``random-mm`` draws its images."""

    per_request: tuple[int, int] = (1, 1)  # fewest and most images in one request
    repeat_ratio: float = 0.0  # probability that an image slot reuses an image already sent
    sizes: tuple[tuple[int, int], ...] = ((224, 224),)  # (width, height); a fresh image picks one
    image_format: str = "png"  # png | jpeg


def parse_size(spec: str) -> tuple[int, int]:
    """``"640x480"`` -> ``(640, 480)``."""
    w, sep, h = spec.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"--mm-image-size wants WxH, e.g. 224x224, got {spec!r}")
    return int(w), int(h)


def parse_range(spec: str) -> tuple[int, int]:
    """``"1..4"`` -> ``(1, 4)``; ``"2"`` -> ``(2, 2)``."""
    lo, sep, hi = spec.partition("..")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"--mm-images-per-request wants N or MIN..MAX, got {spec!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--mm-images-per-request wants 1 <= MIN <= MAX, got {spec!r}")
    return bounds


def image_data_url(seed: int, index: int, size: tuple[int, int], image_format: str) -> str:
    """Image ``index`` of the run: random pixels from (seed, index), as a data URL."""
    from PIL import Image  # only this dataset needs PIL

    pil_format, mime = FORMATS[image_format]
    pixels = random.Random(f"{seed}:{index}").randbytes(size[0] * size[1] * 3)
    buf = io.BytesIO()
    Image.frombytes("RGB", size, pixels).save(buf, format=pil_format)
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


class _Pool:
    """The images sent so far; each fresh one is made once and its data URL kept."""

    def __init__(self, rng: random.Random, opts: ImageOptions, seed: int) -> None:
        self.rng, self.opts, self.seed = rng, opts, seed
        self.urls: list[str] = []

    def draw(self, taken: set[int]) -> tuple[int, bool]:
        """An image for one slot (not one in ``taken``): (its index, whether a repeat)."""
        reusable = [i for i in range(len(self.urls)) if i not in taken]
        if reusable and self.rng.random() < self.opts.repeat_ratio:
            return self.rng.choice(reusable), True
        size = self.rng.choice(self.opts.sizes)
        self.urls.append(image_data_url(self.seed, len(self.urls), size, self.opts.image_format))
        return len(self.urls) - 1, False


def random_mm_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, seed: int, opts: ImageOptions
) -> list[BenchRequest]:
    """``n`` chat requests: a prompt of about ``input_len`` words after 1-N images each."""
    if not 0.0 <= opts.repeat_ratio <= 1.0:
        raise ValueError(f"--image-repeat-ratio must be in [0, 1], got {opts.repeat_ratio}")
    if opts.image_format not in FORMATS:
        raise ValueError(f"image format must be one of {sorted(FORMATS)}, got {opts.image_format}")
    rng = random.Random(seed)
    pool = _Pool(random.Random(seed + 1), opts, seed)  # own stream: lengths don't shift images
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(draw_length(rng, input_len, range_ratio)))
        taken: set[int] = set()
        repeats = 0
        parts: list[dict] = []
        for _slot in range(rng.randint(*opts.per_request)):
            index, repeat = pool.draw(taken)
            taken.add(index)
            repeats += repeat
            parts.append({"type": "image_url", "image_url": {"url": pool.urls[index]}})
        parts.append({"type": "text", "text": words})
        out.append(
            BenchRequest(
                messages=[{"role": "user", "content": parts}],
                max_tokens=draw_length(rng, output_len, range_ratio),
                prompt_words=len(words.split()),
                images=len(taken),
                image_repeats=repeats,
            )
        )
    return out
