"""Image decoding, hashing and preprocessing (transformers' PIL image processors)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from services.image_checks import MAX_IMAGE_PIXELS, ImageError, image_bytes, image_hash

__all__ = ["ImageError", "ImagePreprocessor", "decode_image", "image_bytes", "image_hash"]


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

    def __call__(self, images: list[Image.Image]) -> torch.Tensor:
        """[N] PIL images -> pixel values [N, C, H, W] fp32."""
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float()
