"""The fleet as the dashboard shows it: every instance by role with its load, KV use,
heartbeat age and state (serving / draining / gone).

The routers' registry forgets an instance the moment it expires; the page keeps it for
``gone_s`` more, greyed out, so a crash is visible rather than a silently shorter table.
That memory lives here, not in the registry, which routing reads on every request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.bus import subjects
from services.bus.heartbeat import InstanceInfo, InstanceRegistry

ROLES = (subjects.ROLE_ENCODE, subjects.ROLE_PREFILL, subjects.ROLE_DECODE)


def instance_row(info: InstanceInfo, state: str, age_s: float, inflight: int | None) -> dict:
    """One table row (``inflight``: this gateway's requests there; None: not routed here)."""
    load = info.load
    return {
        "role": info.role,
        "id": info.instance_id,
        "model": info.model,
        "running": load.running,
        "waiting": load.waiting,
        "free_kv_blocks": load.free_kv_blocks,
        "total_kv_blocks": load.total_kv_blocks,
        "inflight": inflight,
        "heartbeat_age_s": round(max(age_s, 0.0), 3),
        "state": state,
    }


class FleetView:
    """Rows for the instances of a disaggregated gateway's fleet.

    ``backend``: a started DisaggregatedBackend (its registry, router and bus). The cache
    service's heartbeats are tracked by a registry of our own (routing has no use for
    them), started on the first ``rows`` call; it goes with the backend's bus.
    ``routers``: every model's router (a gateway of several models; default: the
    backend's), whose leases make the in-flight column.
    """

    def __init__(
        self,
        backend,
        gone_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        routers: list | None = None,
    ):
        self.backend, self.gone_s, self._clock = backend, gone_s, clock
        self._routers = routers
        self._cache_registry: InstanceRegistry | None = None
        self._last: dict[tuple[str, str], InstanceInfo] = {}  # every instance seen lately

    async def rows(self) -> list[dict]:
        """Live and draining instances, then those gone within ``gone_s``, by role and id."""
        await self._start_cache_registry()
        now = self._clock()
        live: dict[tuple[str, str], InstanceInfo] = {}
        for role, registry in self._registries():
            for info in registry.live(role, include_draining=True):
                live[(role, info.instance_id)] = info
        self._last.update(live)
        rows = []
        for key, info in sorted(self._last.items(), key=lambda kv: _order(kv[0])):
            age = now - info.last_seen
            if key in live:
                state = "draining" if info.load.draining else "serving"
            elif age > self.gone_s + self._expiry_s():
                del self._last[key]
                continue
            else:
                state = "gone"
            rows.append(instance_row(info, state, age, self._inflight(info)))
        return rows

    def _registries(self) -> list[tuple[str, InstanceRegistry]]:
        pairs = [(role, self.backend.registry) for role in ROLES]
        if self._cache_registry is not None:
            pairs.append((subjects.ROLE_CACHE, self._cache_registry))
        return pairs

    async def _start_cache_registry(self) -> None:
        bus = self.backend.bus
        if self._cache_registry is not None or bus is None:
            return
        registry = InstanceRegistry(bus, [subjects.ROLE_CACHE], expiry_s=self._expiry_s())
        self._cache_registry = registry  # first: a concurrent poll must not start a second
        await registry.start()

    def _expiry_s(self) -> float:
        return self.backend.config.instance_ttl_s

    def _inflight(self, info: InstanceInfo) -> int | None:
        routers = self._routers or [self.backend.router]
        if info.role == subjects.ROLE_CACHE or any(r is None for r in routers):
            return None
        return sum(r.inflight(info.role, info.instance_id) for r in routers)


def _order(key: tuple[str, str]) -> tuple[int, str]:
    role, iid = key
    return ((*ROLES, subjects.ROLE_CACHE).index(role), iid)
