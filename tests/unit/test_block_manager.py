"""Block manager: exact block ids, ref counts, LRU eviction and prefix-cache hits."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.engine.block_manager import BlockManager, hash_block
from services.engine.request import ImageSpan, Request
from services.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(rid: str, tokens: list[int], images: list[ImageSpan] | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), images=list(images or []))


def compute(bm: BlockManager, req: Request, computed: list[int] | None = None) -> None:
    """Admit ``req``, allocate for all its remaining tokens and cache them (one step)."""
    num_new = req.num_tokens - (len(computed) * BS if computed else 0)
    assert bm.allocate_slots(req, num_new, computed if computed is not None else [])
    req.num_computed_tokens += num_new
    bm.cache_full_blocks(req, req.num_computed_tokens)


def test_hash_block_is_sha256_and_sensitive_to_every_field() -> None:
    base = hash_block(None, [1, 2, 3, 4], [])
    assert len(base) == 64 and int(base, 16) >= 0
    assert base == hash_block(None, [1, 2, 3, 4], [])
    assert base == hash_block("", [1, 2, 3, 4], [])  # no parent == empty parent
    assert base != hash_block("p", [1, 2, 3, 4], [])
    assert base != hash_block(None, [1, 2, 3, 5], [])
    assert base != hash_block(None, [1, 2, 3, 4], ["img"])
    # Length prefixes: regrouping the same characters gives another hash.
    assert hash_block(None, [1], ["ab", "c"]) != hash_block(None, [1], ["a", "bc"])
    assert hash_block(None, [1], ["a", "b"]) != hash_block(None, [1], ["b", "a"])


def test_fresh_pool_and_validation() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    assert bm.free_block_ids == list(range(8))
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_grows_append_only_by_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10)))
    assert bm.allocate_slots(req, 10, [])
    assert req.block_ids == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.usage == pytest.approx(3 / 8)
    req.num_computed_tokens = 10
    assert bm.allocate_slots(req, 2)  # 12 tokens still fit in 3 blocks
    assert req.block_ids == [0, 1, 2]
    assert bm.allocate_slots(req, 3)  # 13 tokens need a 4th block
    assert req.block_ids == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(req, -1)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_slots(req, 1, [])


def test_free_reverse_order_and_lru_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 full; block 2 partial
    compute(bm, a)
    assert a.block_ids == [0, 1, 2]
    assert [bm.block_hash(b) is not None for b in range(4)] == [True, True, False, False]
    bm.free(a)
    assert a.block_ids == [] and len(a.block_hashes) == 2  # hashes depend on tokens only
    assert bm.free_block_ids == [3, 2, 1, 0]  # tail blocks are evicted first
    assert [bm.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert bm.block_hash(0) == a.block_hashes[0]  # still hittable while free

    b = make_request("b", [100 + t for t in range(8)])
    assert bm.allocate_slots(b, 8, bm.get_computed_blocks(b)[0])
    assert b.block_ids == [3, 2]
    c = make_request("c", [200, 201])
    assert bm.allocate_slots(c, 2, [])
    assert c.block_ids == [1]  # least recently freed cached block: its hash is evicted
    assert bm.block_hash(1) is None and bm.cached_block(a.block_hashes[1]) is None
    again = make_request("a2", list(range(9)))
    assert bm.get_computed_blocks(again) == ([0], 4)


def test_prefix_hits_chain_across_requests_and_share_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    compute(bm, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    computed, num_hit = bm.get_computed_blocks(b)
    assert (computed, num_hit) == ([0, 1], 8)
    assert b.block_hashes[:2] == a.block_hashes[:2]
    assert bm.allocate_slots(b, 3, computed)
    assert b.block_ids == [0, 1, 3]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert [bm.ref_count(x) for x in range(4)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.ref_count(x) for x in range(4)] == [1, 1, 0, 1]
    assert bm.free_block_ids[-1] == 2  # only the block no one else holds is free


def test_hit_stops_at_first_differing_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute(bm, make_request("a", list(range(13))))
    tokens = list(range(13))
    tokens[5] = 999  # block 1 differs; block 2 is identical but its parent is not
    assert bm.get_computed_blocks(make_request("b", tokens)) == ([0], 4)


def test_image_hashes_break_the_chain_and_cover_overlapping_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = [9] * 13
    a = make_request("a", tokens, [ImageSpan(offset=3, length=2, image_hash="cat")])
    compute(bm, a)
    h0 = hash_block(None, tokens[0:4], ["cat"])  # token 3 is an image token
    h1 = hash_block(h0, tokens[4:8], ["cat"])  # token 4 too
    h2 = hash_block(h1, tokens[8:12], [])
    assert a.block_hashes == [h0, h1, h2]
    same = make_request("same", tokens, [ImageSpan(3, 2, "cat")])
    assert bm.get_computed_blocks(same) == ([0, 1, 2], 12)
    other = make_request("dog", tokens, [ImageSpan(3, 2, "dog")])
    assert bm.get_computed_blocks(other) == ([], 0)
    # The image moved to block 1: block 0 now hashes without it and misses at once.
    late = make_request("late", tokens, [ImageSpan(4, 1, "cat")])
    assert bm.get_computed_blocks(late) == ([], 0)


def test_cap_keeps_at_least_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute(bm, make_request("a", list(range(8))))  # exactly two full blocks
    assert bm.get_computed_blocks(make_request("b", list(range(8)))) == ([0], 4)
    assert bm.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert bm.get_computed_blocks(make_request("d", [0])) == ([], 0)


def test_hit_and_query_counters() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    assert bm.get_computed_blocks(a) == ([], 0)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (10, 0)
    compute(bm, a)  # allocation and caching do not touch the counters
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (10, 0)
    bm.get_computed_blocks(make_request("b", list(range(10))))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (20, 8)
    bm.get_computed_blocks(make_request("c", [7] * 6))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (26, 8)


def test_failed_allocation_changes_nothing_counting_cached_free_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(bm, a)
    bm.free(a)
    x = make_request("x", [500])
    assert bm.allocate_slots(x, 1, [])
    assert x.block_ids == [3]
    free_before = bm.free_block_ids
    assert free_before == [2, 1, 0]
    # 13 tokens: blocks 0 and 1 hit (both free), 2 more needed, but claiming the hits
    # leaves only one free block.
    b = make_request("b", list(range(13)))
    computed, _ = bm.get_computed_blocks(b)
    assert computed == [0, 1]
    assert not bm.allocate_slots(b, 5, computed)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert bm.free_block_ids == free_before
    assert [bm.ref_count(i) for i in range(4)] == [0, 0, 0, 1]
    assert bm.cached_block(a.block_hashes[0]) == 0 and bm.cached_block(a.block_hashes[1]) == 1
    # 9 tokens need one new block: it fits, and the claimed hits leave the free list.
    c = make_request("c", list(range(9)))
    computed, _ = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, 1, computed)
    assert c.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 0


def test_growth_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(8)))
    compute(bm, req)
    assert not bm.allocate_slots(req, 1)
    assert req.block_ids == [0, 1] and bm.num_free_blocks == 0


def test_duplicate_content_is_registered_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    for req in (a, b):  # both admitted before either is cached: no hits
        assert bm.allocate_slots(req, 5, [])
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    for req in (a, b):
        req.num_computed_tokens = 5
        bm.cache_full_blocks(req, 5)
    assert a.block_hashes == b.block_hashes
    assert bm.cached_block(a.block_hashes[0]) == 0
    assert bm.block_hash(2) is None  # the duplicate stays out of the cache
    bm.free(b)
    bm.free(a)
    assert bm.free_block_ids == [4, 5, 6, 7, 3, 2, 1, 0]
    # Taking the duplicate block must not drop the mapping of the original.
    assert bm.allocate_slots(make_request("x", list(range(100, 124))), 24, [])
    assert bm.free_block_ids == [1, 0]
    assert bm.cached_block(a.block_hashes[0]) == 0


def test_cache_full_blocks_only_counts_computed_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(12)))
    assert bm.allocate_slots(req, 12, [])
    req.num_computed_tokens = 6
    bm.cache_full_blocks(req, 6)  # a chunked prefill step: one full block so far
    assert [bm.block_hash(b) is not None for b in req.block_ids] == [True, False, False]
    req.num_computed_tokens = 12
    bm.cache_full_blocks(req, 12)
    assert [bm.block_hash(b) for b in req.block_ids] == req.block_hashes


def test_allocate_for_import_takes_fresh_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    compute(bm, a)
    bm.free(a)
    assert bm.free_block_ids == [2, 3, 1, 0]
    imp = make_request("imp", list(range(5)))
    assert bm.allocate_for_import(imp, 5) == [2, 3]  # no reuse of cached block 0
    assert imp.block_ids == [2, 3] and bm.ref_count(0) == 0
    assert bm.allocate_for_import(make_request("big", [0] * 12), 12) is None
    assert bm.num_free_blocks == 2
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_for_import(imp, 5)
    imp.num_computed_tokens = 5
    bm.cache_full_blocks(imp, 5)  # the shared hash keeps its first block (0)
    assert bm.cached_block(imp.block_hashes[0]) == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    compute(bm, a)
    assert not bm.reset_prefix_cache()  # refused while block 0 is referenced
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.block_hash(0) is None
    assert bm.get_computed_blocks(make_request("b", list(range(5)))) == ([], 0)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    compute(bm, a)
    assert all(bm.block_hash(b) is None for b in range(8))
    assert bm.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert bm.prefix_query_tokens == 0


@pytest.mark.parametrize("seed", range(40))
def test_ref_counts_match_block_tables_under_random_load(seed: int) -> None:
    """Random arrivals, aborts and tokens on a tiny pool: every ref count equals the
    number of block tables holding the block, and the pool is all free at the end."""
    from services.engine.scheduler import Scheduler
    from services.engine.scheduler_config import SchedulerConfig

    rng = random.Random(seed)
    bm = BlockManager(num_blocks=6 + rng.randint(0, 4), block_size=2)
    sched = Scheduler(SchedulerConfig(max_model_len=12, max_num_batched_tokens=8), bm)
    reqs: list[Request] = []
    for step in range(300):
        if len(reqs) < 12 and rng.random() < 0.3:
            tokens = [rng.choice([1, 3]) for _ in range(rng.randint(1, 11))]
            reqs.append(Request(f"r{len(reqs)}", tokens, SamplingParams(max_tokens=4)))
            sched.add_request(reqs[-1])
        if reqs and rng.random() < 0.05:
            sched.abort_request(rng.choice(reqs).request_id)
        out = sched.schedule()
        holders = Counter(b for r in sched.running for b in r.block_ids)
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [
            holders[b] for b in range(bm.num_blocks)
        ], f"step {step}"
        assert all(len(s.request.block_ids) * 2 >= s.end for s in out.scheduled)
        sched.update_from_output(out, {s.request_id: 3 for s in out.scheduled if s.sample})
        if len(reqs) == 12 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and all(r.is_finished for r in reqs)
    assert bm.num_free_blocks == bm.num_blocks
