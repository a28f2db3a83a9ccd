"""The vector index: exact search while a bucket is small, the HNSW graph past
``ann_from``; buckets never mix; removals stick."""

from __future__ import annotations

import numpy as np

from cache_svc.index import SemanticIndex


def unit(rng, n):
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_exact_then_graph_agree_and_buckets_stay_apart():
    rng = np.random.default_rng(0)
    vecs = unit(rng, 300)
    exact, graph = SemanticIndex(ann_from=10_000), SemanticIndex(ann_from=50)
    for idx in (exact, graph):
        for k, v in enumerate(vecs):
            idx.add("fp", k, v)
        idx.add("other", 10_000, vecs[7])  # the same vector under another fingerprint
    for q in (3, 77, 250):
        noisy = vecs[q] + 0.05 * unit(rng, 1)[0]
        noisy /= np.linalg.norm(noisy)
        for idx in (exact, graph):
            found = idx.search("fp", noisy, 3, 0.5)
            assert found[0][0] == q and found[0][1] > 0.9
            assert all(key < 10_000 for key, _ in found)
    assert exact.search("other", vecs[7], 5, 0.99)[0][0] == 10_000


def test_remove_and_threshold():
    rng = np.random.default_rng(1)
    vecs = unit(rng, 20)
    idx = SemanticIndex(ann_from=10)
    for k, v in enumerate(vecs):
        idx.add("fp", k, v)
    idx.remove(5)
    assert 5 not in idx and len(idx) == 19
    assert all(key != 5 for key, _ in idx.search("fp", vecs[5], 5, -1.0))
    assert idx.search("fp", vecs[6], 5, 0.999)[0][0] == 6
    assert idx.search("nobody", vecs[6], 5, 0.0) == []


def test_bulk_adds_build_the_graph_at_once():
    rng = np.random.default_rng(2)
    vecs = unit(rng, 120)
    bulk, one_by_one = SemanticIndex(ann_from=50), SemanticIndex(ann_from=10_000)
    bulk.add_many("fp", list(range(30)), vecs[:30])  # still exact
    bulk.add_many("fp", list(range(20, 120)), vecs[20:])  # past ann_from; 20..29 again
    for k, v in enumerate(vecs):
        one_by_one.add("fp", k, v)
    assert len(bulk) == 120 and type(bulk._buckets["fp"]).__name__ == "Graph"
    for q in (0, 45, 119):
        (key, score), (same, exact) = (
            bulk.search("fp", vecs[q], 1, 0.5)[0],
            one_by_one.search("fp", vecs[q], 1, 0.5)[0],
        )
        assert key == same == q and abs(score - exact) < 1e-3  # half-precision vectors


def test_a_bucket_grows_its_graph_beside_the_loop():
    from cache_svc.index import Graph

    rng = np.random.default_rng(3)
    vecs = unit(rng, 60)
    idx = SemanticIndex(ann_from=40)
    due = [idx.add("fp", k, v) for k, v in enumerate(vecs[:45])]
    assert due.index(True) == 39 and due.count(True) == 1  # once, at ann_from
    keys, snapshot = idx.snapshot("fp")
    graph = Graph(keys, snapshot)  # what the thread builds
    for k in range(45, 60):  # meanwhile: searched exactly, still added and removed
        idx.add("fp", k, vecs[k])
    idx.remove(3)
    assert idx.search("fp", vecs[50], 1, 0.9)[0][0] == 50
    idx.install("fp", graph, keys)
    assert type(idx._buckets["fp"]).__name__ == "Graph" and len(idx) == 59
    assert idx.search("fp", vecs[55], 1, 0.9)[0][0] == 55
    assert all(key != 3 for key, _ in idx.search("fp", vecs[3], 5, -1.0))
