"""Which instance of a role gets a request: live, healthy, not full, then the policy.

The gateway counts its own in-flight work per instance (a ``Lease`` from pick to the
end of the request's time there): heartbeats are up to a second old, and a burst that
arrives between two of them must still spread. A circuit breaker skips an instance
that failed ``breaker_failures`` dispatches in a row, for ``breaker_cooloff_s``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection

from gateway.config import GatewayConfig
from gateway.events import BackendError
from gateway.policies import Candidate, Policy, PrefixIndex, RouteHint
from services.bus.heartbeat import InstanceInfo, InstanceRegistry

log = logging.getLogger(__name__)


class Lease:
    """One request's claim on an instance; ``release`` (idempotent) ends it."""

    def __init__(self, router: Router, role: str, instance_id: str):
        self.router, self.role, self.instance_id = router, role, instance_id
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.router._inflight[(self.role, self.instance_id)] -= 1

    def failed(self) -> None:
        """The instance failed this request: release, and count it for the breaker
        (unless it is draining: a hand-back at its deadline is no fault)."""
        self.release()
        if not self.router.draining(self.role, self.instance_id):
            self.router.failed(self.role, self.instance_id)


class Router:
    """Picks instances of one model's roles from the registry of live instances."""

    def __init__(
        self,
        registry: InstanceRegistry,
        model: str,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.registry, self.model, self.config = registry, model, config
        self.clock = clock
        self.rng = rng or random.Random()
        self._policies: dict[str, Policy] = {}
        self._inflight: dict[tuple[str, str], int] = {}
        self._failures: dict[tuple[str, str], int] = {}
        self._open_until: dict[tuple[str, str], float] = {}

    def inflight(self, role: str, instance_id: str) -> int:
        """This gateway's requests on the instance now."""
        return self._inflight.get((role, instance_id), 0)

    def live(self, role: str) -> list[InstanceInfo]:
        """Live, serving (not draining) instances of this model."""
        return [i for i in self.registry.live(role) if i.model == self.model]

    def pick(
        self, role: str, *, exclude: Collection[str] = (), hint: RouteHint | None = None
    ) -> Lease:
        """A lease on the instance the policy picks among the admissible ones.

        UNAVAILABLE when no live instance is left (``exclude``: those that already
        failed this request); RESOURCE_EXHAUSTED when every one is full.
        """
        live = [i for i in self.live(role) if i.instance_id not in exclude]
        if not live:
            raise BackendError("UNAVAILABLE", f"no live {role} instance")
        healthy = [i for i in live if not self._is_open(role, i.instance_id)] or live
        limit = self.config.max_inflight_per_instance
        cands = [self._candidate(role, i) for i in healthy]
        cands = [c for c in cands if c.inflight < limit]
        if not cands:
            raise BackendError(
                "RESOURCE_EXHAUSTED",
                f"every {role} instance is at its limit of {limit} requests; retry later",
            )
        chosen = self._policy(role).choose(cands, hint or RouteHint())
        key = (role, chosen.instance_id)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        return Lease(self, role, chosen.instance_id)

    def prefix_match(self, role: str, instance_id: str, hashes) -> int:
        """Leading blocks of ``hashes`` last routed to the instance (prefix_aware's index)."""
        return self._policy(role).prefixes.match(instance_id, hashes)

    def note_prefix(self, role: str, instance_id: str, hashes) -> None:
        self._policy(role).prefixes.record(instance_id, hashes)

    def draining(self, role: str, instance_id: str) -> bool:
        """The instance announced it is shutting down (and still beats)."""
        live = self.registry.live(role, include_draining=True)
        return any(i.instance_id == instance_id and i.load.draining for i in live)

    def failed(self, role: str, instance_id: str) -> None:
        key = (role, instance_id)
        n = self._failures[key] = self._failures.get(key, 0) + 1
        if n >= self.config.breaker_failures:
            self._open_until[key] = self.clock() + self.config.breaker_cooloff_s
            log.warning(
                "%s %s failed %d times in a row: skipped for %.0fs",
                role,
                instance_id,
                n,
                self.config.breaker_cooloff_s,
            )

    def succeeded(self, role: str, instance_id: str) -> None:
        self._failures.pop((role, instance_id), None)
        self._open_until.pop((role, instance_id), None)

    def _is_open(self, role: str, instance_id: str) -> bool:
        until = self._open_until.get((role, instance_id))
        return until is not None and self.clock() < until

    def _candidate(self, role: str, info: InstanceInfo) -> Candidate:
        load = info.load
        used = 1.0 - load.free_kv_blocks / load.total_kv_blocks if load.total_kv_blocks else 0.0
        return Candidate(
            info.instance_id,
            self.inflight(role, info.instance_id),
            load.running + load.waiting,
            used,
        )

    def _policy(self, role: str) -> Policy:
        if role not in self._policies:
            self._policies[role] = Policy(self.config.router_policy, self.rng, PrefixIndex())
        return self._policies[role]
