"""The Qwen2.5-VL vision tower: a 1280x960 photo, ours against transformers' forward.

    python bench/vision_encoder.py              # 2 blocks at real widths, 1 thread
    python bench/vision_encoder.py --depth 4 --threads 2

The checkpoint has Qwen2.5-VL-7B's tower widths (hidden 1280, 16 heads, MLP 3420,
112-pixel windows) with --depth blocks (the last one full attention) and a tiny decoder.
Ours: the encoder service's path (services/images.py encode_batch: the checkpoint's
image processor, then the tower and merger as the encoder model loads them); transformers:
`model.visual(pixel_values, grid_thw)` of `Qwen2_5_VLForConditionalGeneration` on the same
preprocessed pixels. Interleaved, best of --reps. Per-image latency, and images/s with
--batch images in one forward (micro-batching).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from image_cache import real_width_tower  # noqa: E402

from services.config import EngineConfig  # noqa: E402
from services.images import ImagePreprocessor, encode_batch  # noqa: E402
from services.models.factory import load_vision_encoder  # noqa: E402
from services.models.image_grid import ImageOptions  # noqa: E402
from tests.helpers.checkpoints import make_qwen2_5_vl_checkpoint, random_image  # noqa: E402
from tests.helpers.reference import load_hf  # noqa: E402


def best(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="epd-vision-"))
    ckpt = make_qwen2_5_vl_checkpoint(
        root, max_pixels=1280 * 1280, vision=real_width_tower(args.depth)
    )
    ours = load_vision_encoder(EngineConfig(model=str(ckpt), dtype="float32")).model
    prep = ImagePreprocessor(ckpt)
    theirs = load_hf(ckpt).model.visual
    photos = [random_image(i, (1280, 960)) for i in range(args.batch)]
    opts = ImageOptions()
    pix = prep(photos, opts)

    def ours_fn(n):
        return lambda: encode_batch(ours, prep, [(p, opts) for p in photos[:n]], "cpu")

    def theirs_fn(n):
        patches = int(pix["image_grid_thw"][:n].prod(-1).sum())
        x, grid = pix["pixel_values"][:patches], pix["image_grid_thw"][:n]

        @torch.inference_mode()
        def run():
            prep(photos[:n], opts)  # the same preprocessing ours does
            return theirs(x, grid_thw=grid).pooler_output

        return run

    out = torch.cat(ours_fn(1)())
    ref = theirs_fn(1)()
    assert torch.allclose(out, ref, atol=1e-3, rtol=1e-3), (out - ref).abs().max()
    tokens = out.shape[0]
    print(
        f"Qwen2.5-VL tower, real widths, {args.depth} blocks; a 1280x960 photo "
        f"({tokens} image tokens); {args.threads} thread(s), best of {args.reps}"
    )
    print(f"{'':<22} {'ours':>9} {'transformers':>13} {'ratio':>7}")
    for label, n in (("one image (s)", 1), (f"{args.batch} images (img/s)", args.batch)):
        a, b = best(ours_fn(n), args.reps), best(theirs_fn(n), args.reps)
        if n == 1:
            print(f"{label:<22} {a:9.2f} {b:13.2f} {b / a:6.2f}x")
        else:
            print(f"{label:<22} {n / a:9.3f} {n / b:13.3f} {b / a:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
