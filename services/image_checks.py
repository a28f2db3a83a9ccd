"""Image checks that never decode pixels (PIL reads the header only; no torch).

The gateway runs these on every image: format, dimensions and the pixel limit come from
the file's header, and the hash from its bytes. The full decode happens once, in the
service that uses the pixels (the encoder), off any event loop.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# Larger images are refused before anything decodes them (a 12-megapixel photo is 12 M).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image is missing, undecodable or over a limit."""


@dataclass(frozen=True)
class ImageHeader:
    format: str  # "PNG", "JPEG", "WEBP", ...
    width: int
    height: int
    nbytes: int


def probe_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageHeader:
    """Format and size from the header alone; ImageError when it is no image or too big."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise ImageError("image must be non-empty bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            header = ImageHeader(img.format or "", img.width, img.height, len(data))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"undecodable image: {e}") from e
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large: {e}") from e
    if header.width <= 0 or header.height <= 0:
        raise ImageError(f"image has no pixels ({header.width}x{header.height})")
    if header.width * header.height > max_pixels:
        raise ImageError(
            f"image too large: {header.width}x{header.height} is over {max_pixels} pixels"
        )
    return header


def image_bytes(data) -> bytes:
    """Canonical bytes to hash: the encoded bytes as sent, or a PIL image's raw pixels."""
    if isinstance(data, Image.Image):
        rgb = data.convert("RGB")
        return f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()
    return bytes(data)


def image_hash(data, fingerprint: str = "") -> str:
    """sha256 over the image bytes and the model / preprocessing fingerprint."""
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(image_bytes(data))
    return h.hexdigest()
