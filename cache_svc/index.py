"""Nearest questions among the cache entries of one fingerprint.

Entries are only ever compared with entries of the same fingerprint (model, system
prompt, history, sampling, images, tenant), so every fingerprint has a bucket of its own.
A bucket is searched exactly (one matrix-vector product over unit vectors) while small,
and through an HNSW graph (usearch, half-precision vectors) once it holds ``ann_from``
entries: exact search over a million 384-dim vectors reads 1.5 GB (~50-80 ms), the
graph ~6 ms (p50 on the development machine; ~2.5 ms at 200k).

Building a graph costs 1.6 ms an entry at 200k entries on the development machine's two
cores, more as it grows, so it never happens on the event loop: a bucket that reaches
``ann_from`` keeps being searched exactly while its graph is built in a thread
(``snapshot`` / ``Graph`` / ``install``), and a rebuild at start fills a fresh index in
threads (``add_many``, all cores).
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


class Graph:
    """An HNSW graph of unit vectors (blocking to build: off the event loop)."""

    def __init__(self, keys: list[int], vectors: np.ndarray) -> None:
        # Measured on 200k vectors drawn like MiniLM's embeddings of questions, a stored one
        # asked at cosine 0.85 (bench/semantic_cache.py --only scale): usearch's defaults
        # (16 links a node, expansion 128 / 64) find those stored first only 81 % of the
        # time; 32 links with a 128 search find 99.6 %, for 1.6 instead of 1.5 ms an entry
        # to build and ~2.5 instead of ~1 ms a search. Half precision loses nothing there.
        self.index = Index(
            ndim=DIM,
            metric="cos",
            dtype="f16",
            connectivity=32,
            expansion_add=64,
            expansion_search=128,
        )
        self.add_many(keys, vectors)

    def __len__(self) -> int:
        return len(self.index)

    def add(self, key: int, vec: np.ndarray) -> None:
        if key not in self.index:
            self.index.add(key, vec)

    def add_many(self, keys: list[int], vectors: np.ndarray) -> None:
        new = [i for i, k in enumerate(keys) if k not in self.index]
        if new:  # every core
            self.index.add(np.array(keys, np.uint64)[new], vectors[new], threads=0)

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
        self._buckets: dict[str, _Exact | Graph] = {}
        self._bucket_of: dict[int, str] = {}
        self._growing: set[str] = set()  # buckets whose graph is being built

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, key: int) -> bool:
        return key in self._bucket_of

    def add(self, fingerprint: str, key: int, vec: np.ndarray) -> bool:
        """Add one entry; True when its bucket is due a graph (``snapshot``, build it
        off the loop, ``install``): it stays exact until then."""
        if key in self._bucket_of:
            return False
        bucket = self._buckets.setdefault(fingerprint, _Exact())
        bucket.add(key, vec)
        self._bucket_of[key] = fingerprint
        due = isinstance(bucket, _Exact) and len(bucket) >= self.ann_from
        if due and fingerprint not in self._growing:
            self._growing.add(fingerprint)
            return True
        return False

    def add_many(self, fingerprint: str, keys: list[int], vectors: np.ndarray) -> None:
        """Add entries in bulk, building a bucket's graph at once when they take it past
        ``ann_from``. Blocking: for an index the event loop does not use yet."""
        fresh = [i for i, k in enumerate(keys) if k not in self._bucket_of]
        keys, vectors = [keys[i] for i in fresh], vectors[fresh]
        bucket = self._buckets.setdefault(fingerprint, _Exact())
        if isinstance(bucket, _Exact) and len(bucket) + len(keys) >= self.ann_from:
            n = len(bucket)
            bucket = Graph(bucket.keys + keys, np.concatenate([bucket.vectors[:n], vectors]))
            self._buckets[fingerprint] = bucket
        elif isinstance(bucket, Graph):
            bucket.add_many(keys, vectors)
        else:
            for key, vec in zip(keys, vectors, strict=True):
                bucket.add(key, vec)
        self._bucket_of.update(dict.fromkeys(keys, fingerprint))

    def snapshot(self, fingerprint: str) -> tuple[list[int], np.ndarray]:
        """The keys and vectors of an exact bucket (copies: a graph is built from them)."""
        bucket = self._buckets.get(fingerprint)
        if not isinstance(bucket, _Exact):
            return [], np.zeros((0, DIM), np.float32)
        return list(bucket.keys), bucket.vectors[: len(bucket)].copy()

    def install(self, fingerprint: str, graph: Graph | None, snapshot: list[int]) -> None:
        """Replace an exact bucket by ``graph`` (built from ``snapshot``), with what was
        added and removed since; None: the build failed, the bucket stays exact."""
        self._growing.discard(fingerprint)
        bucket = self._buckets.get(fingerprint)
        if graph is None or not isinstance(bucket, _Exact):
            return
        now, then = set(bucket.keys), set(snapshot)
        for key in now - then:
            graph.add(key, bucket.vectors[bucket.row[key]])
        for key in then - now:
            graph.remove(key)
        self._buckets[fingerprint] = graph

    def remove(self, key: int) -> None:
        fingerprint = self._bucket_of.pop(key, None)
        if fingerprint is None:
            return
        bucket = self._buckets[fingerprint]
        bucket.remove(key)
        if not len(bucket):
            del self._buckets[fingerprint]

    def search(
        self, fingerprint: str, vec: np.ndarray, k: int, min_score: float
    ) -> list[tuple[int, float]]:
        """Up to ``k`` (key, cosine) of this fingerprint with cosine >= ``min_score``,
        best first."""
        bucket = self._buckets.get(fingerprint)
        if bucket is None:
            return []
        return [(key, s) for key, s in bucket.search(vec, k) if s >= min_score]
