"""Routing policies: which of the candidate instances of a role gets a request.

A policy sees each candidate's load as this gateway knows it (its own in-flight work,
exact and immediate) merged with the instance's last heartbeat (seconds old, but it
counts other gateways' work), and returns one candidate. ``prefix_aware`` also keeps
an approximate index of which prompt prefixes were routed where (SGLang's router keeps
a radix tree of the same): the instance that last prefilled a prefix most likely still
holds its KV blocks in its prefix cache.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

POLICIES = (
    "least_loaded",
    "power_of_two",
    "round_robin",
    "random",
    "consistent_hash",
    "prefix_aware",
)


@dataclass
class Candidate:
    """One live, admissible instance of a role."""

    instance_id: str
    inflight: int  # this gateway's requests on it now
    queued: int  # running + waiting, from its last heartbeat
    kv_used: float  # fraction of its KV blocks in use, from its last heartbeat

    @property
    def load(self) -> int:
        """Requests on the instance: our own count is exact; the heartbeat's may add
        other gateways' (it includes ours too, but late)."""
        return max(self.inflight, self.queued)

    def key(self) -> tuple[int, float]:
        return self.load, self.kv_used


@dataclass
class RouteHint:
    """What a request offers the policies: a session key and the prompt's block hashes."""

    session_key: str = ""
    block_hashes: Sequence[int] = ()


def block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (the gateway's own view of prefixes;
    the engines' sha256 chain is not needed to guess where a prefix lives)."""
    out, h = [], 0
    for i in range(block_tokens, len(token_ids) + 1, block_tokens):
        h = hash((h, tuple(token_ids[i - block_tokens : i])))
        out.append(h)
    return out


class PrefixIndex:
    """LRU set of (instance, block hash) pairs routed recently; bounded in entries."""

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()

    def match(self, instance_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` were last routed to ``instance_id``."""
        n = 0
        for h in hashes:
            if (instance_id, h) not in self._seen:
                break
            n += 1
        return n

    def record(self, instance_id: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._seen[(instance_id, h)] = None
            self._seen.move_to_end((instance_id, h))
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)


class Policy:
    """Picks one of the candidates (never empty) for a request."""

    def __init__(
        self,
        name: str,
        rng: random.Random | None = None,
        prefixes: PrefixIndex | None = None,
        balance_slack: int = 4,
    ):
        """``balance_slack``: prefix_aware follows a cached prefix only to an instance
        at most this many requests busier than the least-loaded one."""
        if name not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name = name
        self.rng = rng or random.Random()
        self.prefixes = prefixes or PrefixIndex()
        self.balance_slack = balance_slack
        self._rr = 0
        self._choose: Callable[[list[Candidate], RouteHint], Candidate] = getattr(self, f"_{name}")

    def choose(self, candidates: list[Candidate], hint: RouteHint) -> Candidate:
        chosen = self._choose(candidates, hint)
        if hint.block_hashes:
            self.prefixes.record(chosen.instance_id, hint.block_hashes)
        return chosen

    def _least_loaded(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        """Least loaded; round robin among ties, so a burst spreads evenly."""
        best = min(c.key() for c in cands)
        tied = [c for c in cands if c.key() == best]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _power_of_two(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        two = self.rng.sample(cands, min(2, len(cands)))
        return min(two, key=Candidate.key)

    def _round_robin(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        self._rr += 1
        return cands[self._rr % len(cands)]

    def _random(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        return self.rng.choice(cands)

    def _consistent_hash(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        """Rendezvous hashing on the session key: the same key lands on the same
        instance on every gateway, and only 1/N of the keys move when one joins or
        leaves. No key: least loaded."""
        if not hint.session_key:
            return self._least_loaded(cands, hint)

        def weight(c: Candidate) -> bytes:
            return hashlib.blake2b(
                f"{hint.session_key}\0{c.instance_id}".encode(), digest_size=8
            ).digest()

        return max(cands, key=weight)

    def _prefix_aware(self, cands: list[Candidate], hint: RouteHint) -> Candidate:
        """The instance holding the longest prefix of this prompt, unless it is busier
        than the least-loaded one by more than ``balance_slack``; else least loaded."""
        if hint.block_hashes:
            floor = min(c.load for c in cands)
            matches = [
                (self.prefixes.match(c.instance_id, hint.block_hashes), c)
                for c in cands
                if c.load <= floor + self.balance_slack
            ]
            best = max(m for m, _ in matches)
            if best > 0:
                return min((c for m, c in matches if m == best), key=Candidate.key)
        return self._least_loaded(cands, hint)
