"""Redis keys of the embedding cache (torch-free: the gateway names keys too)."""

from __future__ import annotations

import re

KEY_PREFIX = "epd:emb"
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_FINGERPRINT_RE = re.compile(r"[A-Za-z0-9._\-]{1,128}")


def embedding_key(fingerprint: str, image_hash: str) -> str:
    """Redis key of one image's embedding under one model; ValueError on bad parts."""
    if not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise ValueError(f"invalid model fingerprint {fingerprint!r}")
    if not _HASH_RE.fullmatch(image_hash):
        raise ValueError(f"image hash must be 64 lowercase hex chars, got {image_hash!r}")
    return f"{KEY_PREFIX}:{fingerprint}:{image_hash}"
