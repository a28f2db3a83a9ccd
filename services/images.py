"""Image decoding, hashing and preprocessing (transformers' PIL image processors)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from services.image_checks import MAX_IMAGE_PIXELS, ImageError, image_bytes, image_hash
from services.models.image_grid import ImageOptions

__all__ = [
    "ImageError",
    "ImagePreprocessor",
    "decode_image",
    "encode_batch",
    "image_bytes",
    "image_hash",
]


def decode_image(data: bytes | Image.Image) -> Image.Image:
    """Bytes (any format PIL reads) or a PIL image -> an RGB PIL image."""
    if isinstance(data, Image.Image):
        return data.convert("RGB")
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise ImageError("image must be non-empty bytes or a PIL image")
    try:
        img = Image.open(io.BytesIO(bytes(data)))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"image too large: {img.width}x{img.height}")
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"undecodable image: {e}") from e
    return img.convert("RGB")


class ImagePreprocessor:
    """The checkpoint's image processor, through transformers (PIL backend): from
    ``preprocessor_config.json``, or nested in ``processor_config.json`` as transformers 5's
    ``LlavaProcessor.save_pretrained`` writes it."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(
                str(model_dir), local_files_only=True, backend="pil"
            )
        except TypeError:  # transformers < 5 has no backend argument
            self.processor = AutoImageProcessor.from_pretrained(
                str(model_dir), local_files_only=True, use_fast=False
            )

    def __call__(self, images: list[Image.Image], options: ImageOptions) -> dict:
        """[N] PIL images -> the tower's inputs: ``pixel_values`` fp32 ([N, C, H, W], or
        Qwen's [patches, C*T*P*P] with ``image_grid_thw`` [N, 3])."""
        kwargs = {}
        if not options.is_default:  # only processors with a pixel budget accept these
            size = self.processor.size
            kwargs["size"] = {
                "shortest_edge": options.min_pixels or size.shortest_edge,
                "longest_edge": options.max_pixels or size.longest_edge,
            }
        out = self.processor(images=images, return_tensors="pt", **kwargs)
        inputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        inputs["pixel_values"] = inputs["pixel_values"].float()
        return inputs


def encode_batch(model, preprocessor: ImagePreprocessor, items: list, device) -> list:
    """``items`` [(PIL image, ImageOptions)] -> one embedding per image, in order: the
    images that share options are preprocessed and run through the tower together."""
    out: list = [None] * len(items)
    groups: dict[ImageOptions, list[int]] = {}
    for i, (_, options) in enumerate(items):
        groups.setdefault(options, []).append(i)
    for options, idx in groups.items():
        inputs = preprocessor([items[i][0] for i in idx], options)
        embeds = model.encode_images({k: v.to(device) for k, v in inputs.items()})
        for i, emb in zip(idx, embeds, strict=True):
            out[i] = emb
    return out
