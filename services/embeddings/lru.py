"""Embeddings by image hash in process memory, least recently used evicted past a size.

In front of the fleet's Redis store (``services.embeddings.store``) in both places that run a vision
tower: the encoder service and ``serve all``. A repeat is then answered without a Redis
round trip, and still when Redis is down, slow or evicted the entry, so a repeated image
is encoded once per process whatever Redis does.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# A few hundred CLIP ViT-B/16 images (196 x 768 fp32, ~0.6 MB each).
DEFAULT_BYTES = 256 << 20


class EmbeddingLRU:
    """Embeddings by image hash, least recently used evicted past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> torch.Tensor | None:
        emb = self._items.get(key)
        if emb is not None:
            self._items.move_to_end(key)
        return emb

    def put(self, key: str, emb: torch.Tensor) -> None:
        size = emb.numel() * emb.element_size()
        if size > self.max_bytes:
            return  # one entry may not flush the whole cache
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = emb
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, gone = self._items.popitem(last=False)
            self.bytes -= gone.numel() * gone.element_size()
