"""The similarity signal: which route's example utterances the message is nearest to.

Example vectors are computed once per config load; a decision is one matrix-vector
product over them (a few hundred x 384: microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.semantic_router.config import Similarity


@dataclass(frozen=True)
class SimilarityVote:
    """The route the similarity signal names, and the cosine that backs it."""

    route: str
    score: float


class RouteIndex:
    """Unit vectors of every route's examples, with the route of each row."""

    def __init__(self, routes: list[str], vectors: np.ndarray, config: Similarity):
        self.routes = routes  # route name per row
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [n, dim]
        self.config = config
        self.names = sorted(set(routes))
        rows = np.array([self.names.index(r) for r in routes], dtype=np.int64)
        self._row_route = rows
        centroids = np.stack([self.vectors[rows == i].mean(0) for i in range(len(self.names))])
        norms = np.linalg.norm(centroids, axis=1, keepdims=True)
        self.centroids = (centroids / np.maximum(norms, 1e-9)).astype(np.float32)

    def vote(self, vec: np.ndarray) -> SimilarityVote | None:
        """The nearest route (centroid, or a cosine-weighted top-k vote), or None when
        even the best match is under the threshold."""
        if self.config.method == "centroid":
            sims = self.centroids @ vec
            best = int(np.argmax(sims))
            return self._if_close(self.names[best], float(sims[best]))
        sims = self.vectors @ vec
        k = min(self.config.k, len(sims))
        top = np.argpartition(-sims, k - 1)[:k]
        weight = np.zeros(len(self.names), np.float32)
        np.add.at(weight, self._row_route[top], np.maximum(sims[top], 0.0))
        winner = int(np.argmax(weight))
        score = float(sims[top][self._row_route[top] == winner].max())
        return self._if_close(self.names[winner], score)

    def _if_close(self, route: str, score: float) -> SimilarityVote | None:
        return SimilarityVote(route, score) if score >= self.config.threshold else None
