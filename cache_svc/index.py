"""Nearest questions among the cache entries of one fingerprint.

Entries are only ever compared with entries of the same fingerprint (model, system
prompt, history, sampling, images, tenant), so every fingerprint has a bucket of its own.
A bucket is searched exactly (one matrix-vector product over unit vectors) while small,
and through an HNSW graph (usearch, half-precision vectors) once it holds ``ann_from``
entries: exact search over a million 384-dim vectors costs ~50 ms, the graph well
under a millisecond.
"""

from __future__ import annotations

import numpy as np
from usearch.index import Index

DIM = 384


class _Exact:
    def __init__(self) -> None:
        self.vectors = np.zeros((16, DIM), np.float32)
        self.keys: list[int] = []
        self.row: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: int, vec: np.ndarray) -> None:
        if key in self.row:
            return
        n = len(self.keys)
        if n == len(self.vectors):
            self.vectors = np.concatenate([self.vectors, np.zeros_like(self.vectors)])
        self.vectors[n] = vec
        self.keys.append(key)
        self.row[key] = n

    def remove(self, key: int) -> None:
        r = self.row.pop(key, None)
        if r is None:
            return
        last = len(self.keys) - 1
        if r != last:  # the last row moves into the hole
            self.vectors[r] = self.vectors[last]
            self.keys[r] = self.keys[last]
            self.row[self.keys[r]] = r
        self.keys.pop()

    def search(self, vec: np.ndarray, k: int) -> list[tuple[int, float]]:
        n = len(self.keys)
        if n == 0:
            return []
        scores = self.vectors[:n] @ vec
        top = np.argpartition(-scores, min(k, n) - 1)[:k] if n > k else np.arange(n)
        top = top[np.argsort(-scores[top])]
        return [(self.keys[i], float(scores[i])) for i in top]


class _Graph:
    def __init__(self, exact: _Exact) -> None:
        self.index = Index(ndim=DIM, metric="cos", dtype="f16")
        self.index.add(np.array(exact.keys, np.uint64), exact.vectors[: len(exact)])

    def __len__(self) -> int:
        return len(self.index)

    def add(self, key: int, vec: np.ndarray) -> None:
        if key not in self.index:
            self.index.add(key, vec)

    def remove(self, key: int) -> None:
        self.index.remove(key)

    def search(self, vec: np.ndarray, k: int) -> list[tuple[int, float]]:
        found = self.index.search(vec, k)
        return [
            (int(key), 1.0 - float(d)) for key, d in zip(found.keys, found.distances, strict=True)
        ]


class SemanticIndex:
    """Unit vectors by entry key, bucketed by fingerprint."""

    def __init__(self, ann_from: int = 20_000):
        self.ann_from = ann_from
        self._buckets: dict[str, _Exact | _Graph] = {}
        self._bucket_of: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, key: int) -> bool:
        return key in self._bucket_of

    def add(self, fingerprint: str, key: int, vec: np.ndarray) -> None:
        if key in self._bucket_of:
            return
        bucket = self._buckets.setdefault(fingerprint, _Exact())
        bucket.add(key, vec)
        self._bucket_of[key] = fingerprint
        if isinstance(bucket, _Exact) and len(bucket) >= self.ann_from:
            self._buckets[fingerprint] = _Graph(bucket)

    def remove(self, key: int) -> None:
        fingerprint = self._bucket_of.pop(key, None)
        if fingerprint is None:
            return
        bucket = self._buckets[fingerprint]
        bucket.remove(key)
        if not len(bucket):
            del self._buckets[fingerprint]

    def search(self, fingerprint: str, vec: np.ndarray, k: int,
               min_score: float) -> list[tuple[int, float]]:  # fmt: skip
        """Up to ``k`` (key, cosine) of this fingerprint with cosine >= ``min_score``,
        best first."""
        bucket = self._buckets.get(fingerprint)
        if bucket is None:
            return []
        return [(key, s) for key, s in bucket.search(vec, k) if s >= min_score]
