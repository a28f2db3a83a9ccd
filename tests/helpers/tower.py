"""Images for `serve all`'s embedding-cache tests, and a counter of its vision-tower passes."""

from __future__ import annotations

import io

import torch

from gateway.aggregated import AggregatedBackend
from tests.helpers.checkpoints import random_image


def png(seed: int) -> bytes:
    """A random image as PNG bytes (the same seed, the same bytes)."""
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    return buf.getvalue()


class Tower:
    """Counts the vision-tower passes of a backend (wraps its real encode function)."""

    def __init__(self, backend: AggregatedBackend) -> None:
        self.passes = 0
        self._encode = backend.images.encode
        backend.images.encode = self

    async def __call__(self, data: bytes, options) -> torch.Tensor:
        self.passes += 1
        return await self._encode(data, options)
