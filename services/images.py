"""Image decoding, hashing and preprocessing (transformers' PIL image processors)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image could not be decoded."""


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
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ImageError(f"undecodable image: {e}") from e
    return img.convert("RGB")


def image_bytes(data: bytes | Image.Image) -> bytes:
    """Canonical bytes to hash: the encoded bytes as sent, or a PIL image's raw pixels."""
    if isinstance(data, Image.Image):
        rgb = data.convert("RGB")
        return f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()
    return bytes(data)


def image_hash(data: bytes | Image.Image, fingerprint: str = "") -> str:
    """sha256 over the image bytes and the model / preprocessing fingerprint."""
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(image_bytes(data))
    return h.hexdigest()


class ImagePreprocessor:
    """The checkpoint's ``preprocessor_config.json``, through transformers (PIL backend)."""

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
        self.config_json = (Path(model_dir) / "preprocessor_config.json").read_text()

    def __call__(self, images: list[Image.Image]) -> torch.Tensor:
        """[N] PIL images -> pixel values [N, C, H, W] fp32."""
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float()
