"""Paged-KV block pool with prefix caching (torch-free, STYLE.md 2 and 4).

Blocks are ids into one preallocated KV pool. A block full of computed tokens gets a
sha256 hash chained from its parent block's hash, its token ids and the hashes of the
images that cover it; a later request whose prefix hashes the same reuses the block
instead of recomputing it. Unreferenced blocks keep their hash and stay hittable until
they are taken again for new tokens, least recently freed first (LRU).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from services.engine.request import Request


def hash_block(
    parent_hash: str | None, token_ids: Sequence[int], image_hashes: Sequence[str]
) -> str:
    """Return the sha256 hex digest that identifies one full block.

    Every field is length-prefixed so that no two different (parent, tokens, images)
    triples share a byte encoding.
    """
    digest = hashlib.sha256()
    parent = (parent_hash or "").encode()
    digest.update(struct.pack("<I", len(parent)) + parent)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(struct.pack("<I", len(image_hashes)))
    for image_hash in image_hashes:
        encoded = image_hash.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return digest.hexdigest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns block ids ``0 .. num_blocks - 1``: ref counts, hashes and the free list."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
    ):
        """``num_state_slots``: hybrid models' recurrent-state slots, one handed out with
        a request's first blocks and taken back with them (mamba_state.py)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[str | None] = [None] * num_blocks
        # Unreferenced blocks in eviction order: head = least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[str, int] = {}
        # request_id -> how many leading blocks of that request already carry a hash, so
        # cache_full_blocks only hashes the blocks that filled up since its last call.
        self._num_hashed: dict[str, int] = {}
        # Prefix-cache accounting: tokens looked up vs tokens found (hit rate = hit/query).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.uses_state = num_state_slots > 0
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # pop() takes slot 0 first

    # ----------------------------------------------------------------- inspection

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached or not); all of them can be taken."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by at least one request."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they will be taken (head first)."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> str | None:
        """The prefix-cache hash of ``block_id``, or None if it is not cached."""
        return self._hashes[block_id]

    def cached_block(self, block_hash: str) -> int | None:
        """The block registered under ``block_hash``, if any."""
        return self._hash_to_block.get(block_hash)

    # ----------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the request's leading tokens.

        Returns (block ids, tokens they cover). Never covers every token: the last one
        must be computed to get the logits the next token is sampled from. Only the hit
        counters and ``request.block_hashes`` (a pure function of the tokens) change.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index in range(max_blocks):
            block_id = self._hash_to_block.get(self._block_hash_of(request, index))
            if block_id is None:
                break
            hits.append(block_id)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_query_tokens += request.num_tokens
        self.prefix_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every block now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_hashed.get(request.request_id, 0)
        for index in range(start, num_full):
            block_id = request.block_ids[index]
            if self._hashes[block_id] is not None:
                continue  # claimed from the cache at admission
            block_hash = self._block_hash_of(request, index)
            # Two requests may compute the same prefix concurrently; the first mapping
            # wins and the duplicate block stays unhashed (evictable, never hit).
            if block_hash not in self._hash_to_block:
                self._hash_to_block[block_hash] = block_id
                self._hashes[block_id] = block_hash
        self._num_hashed[request.request_id] = max(start, num_full)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        self._hash_to_block.clear()
        self._hashes = [None] * self.num_blocks
        return True

    def _block_hash_of(self, request: Request, index: int) -> str:
        """Hash of full block ``index`` of the request, extending request.block_hashes."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            start, end = i * self.block_size, (i + 1) * self.block_size
            # The grid too: it places the image's rotary positions (M-RoPE), and a span
            # from another service could pair a hash with a grid of its own.
            image_hashes = [
                image.image_hash + "".join(f":{g}" for g in image.grid)
                for image in request.images
                if image.offset < end and image.offset + image.length > start
            ]
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, request.all_token_ids[start:end], image_hashes))
        return hashes[index]

    # ----------------------------------------------------------------- allocation

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens``.

        ``computed_blocks`` (from get_computed_blocks) marks first admission: they are
        claimed first and set ``num_computed_tokens`` / ``num_cached_tokens``. Returns
        False, changing nothing, when the free pool is too small.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        admitting = computed_blocks is not None
        computed = computed_blocks or []
        if admitting and request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_computed = len(computed) * self.block_size if admitting else request.num_computed_tokens
        held = len(request.block_ids) + len(computed)
        num_needed = max(0, _cdiv(num_computed + num_new_tokens, self.block_size) - held)
        # A cached block sitting in the free list stops being free once claimed.
        num_claimed_free = sum(1 for b in computed if self._ref_counts[b] == 0)
        if num_needed > len(self._free) - num_claimed_free:
            return False
        if not self._take_slot(request):
            return False
        if admitting:
            for block_id in computed:
                self._claim(block_id)
            request.block_ids.extend(computed)
            request.num_computed_tokens = request.num_cached_tokens = num_computed
            self._num_hashed[request.request_id] = len(computed)
        request.block_ids.extend(self._take_free() for _ in range(num_needed))
        return True

    def allocate_for_import(self, request: Request, num_tokens: int) -> list[int] | None:
        """Fresh blocks for ``num_tokens`` tokens of KV computed elsewhere (a prefill
        instance); no prefix reuse. They become ``request.block_ids``; the caller sets
        ``num_computed_tokens`` once the KV has landed. None if the pool is too small.
        """
        if request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_needed = _cdiv(num_tokens, self.block_size)
        if num_needed > len(self._free) or not self._take_slot(request):
            return None
        request.block_ids.extend(self._take_free() for _ in range(num_needed))
        self._num_hashed[request.request_id] = 0
        return list(request.block_ids)

    def free(self, request: Request) -> None:
        """Drop the request's references; its blocks stay cached until taken again."""
        # Reverse order: the tail of a sequence is the least likely prefix of another
        # request, so its blocks should be evicted before the head's.
        for block_id in reversed(request.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
        request.block_ids.clear()
        self._num_hashed.pop(request.request_id, None)
        if request.state_slot is not None:
            self._free_slots.append(request.state_slot)
            request.state_slot = None

    def free_tail(self, request: Request, num_tokens: int) -> list[int]:
        """Give back the request's blocks beyond the first ``num_tokens`` tokens: the
        slots of rejected speculative drafts (the one exception to append-only tables).

        Such blocks were taken fresh for the drafts and never hashed (only blocks full of
        computed, accepted tokens are), so nothing in the prefix cache changes; they go
        to the head of the free list, the first taken again. Returns their ids.
        """
        keep = _cdiv(num_tokens, self.block_size)
        tail = request.block_ids[keep:]
        del request.block_ids[keep:]
        for block_id in reversed(tail):  # the first tail block ends up at the head
            if self._hashes[block_id] is not None:
                raise RuntimeError(f"block {block_id} of a rolled-back draft has a hash")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        hashed = self._num_hashed.get(request.request_id)
        if hashed is not None:
            self._num_hashed[request.request_id] = min(hashed, keep)
        return tail

    def _take_slot(self, request: Request) -> bool:
        """A state slot for the request if the model keeps state and it has none yet;
        False when every slot is held."""
        if not self.uses_state or request.state_slot is not None:
            return True
        if not self._free_slots:
            return False
        request.state_slot = self._free_slots.pop()
        return True

    def _claim(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old_hash = self._hashes[block_id]
        if old_hash is not None:
            # The block is about to hold other tokens: its old content is gone.
            if self._hash_to_block.get(old_hash) == block_id:
                del self._hash_to_block[old_hash]
            self._hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id
