"""What ``GET /dashboard/api/state`` answers: this gateway, every instance it can see
and its last minutes (gateway/dashboard/stats.py). Cheap enough for the event loop:
a few dozen rows and at most ``buckets * max_samples`` floats to sort per poll."""

from __future__ import annotations

import time

from gateway.core import GatewayCore
from gateway.dashboard.fleet import FleetView


class DashboardState:
    """Builds the state document of one gateway (fleet or ``serve all``). ``cores``:
    every model it serves (default: ``core``, the default model's); the stats are the
    default model's."""

    def __init__(self, core: GatewayCore, cores: list[GatewayCore] | None = None):
        self.core = core
        self.cores = cores or [core]
        self.started = time.monotonic()
        self._fleet: FleetView | None = None

    async def document(self) -> dict:
        core = self.core
        backend = core.backend
        fleet = hasattr(backend, "registry")  # DisaggregatedBackend; else the in-process engine
        instances = [self._gateway_row(backend)]
        instances += await self._fleet_rows(backend) if fleet else [self._engine_row(backend)]
        names = {c.info.fingerprint: c.info.model_id for c in self.cores}
        for row in instances:  # fingerprints are for machines; people know the model's name
            row["model"] = names.get(row["model"], row["model"])
        return {
            "model": ", ".join(names.values()),
            "mode": "disaggregated" if fleet else "aggregated",
            "uptime_s": round(time.monotonic() - self.started, 1),
            "instances": instances,
            "stats": core.stats.snapshot(),
        }

    async def _fleet_rows(self, backend) -> list[dict]:
        if backend.registry is None:  # not started yet
            return []
        if self._fleet is None:
            self._fleet = FleetView(backend, routers=[c.backend.router for c in self.cores])
        return await self._fleet.rows()

    def _gateway_row(self, backend) -> dict:
        inflight = sum(c.inflight for c in self.cores)
        return {
            "role": "gateway",
            "id": getattr(backend, "gateway_id", "") or "this gateway",
            "model": ", ".join(c.info.model_id for c in self.cores),
            "running": inflight,
            "waiting": 0,
            "free_kv_blocks": None,
            "total_kv_blocks": None,
            "inflight": inflight,
            "heartbeat_age_s": 0.0,
            "state": "serving" if backend.ready() else "not ready",
        }

    def _engine_row(self, backend) -> dict:
        """``serve all``: the engine in this process (its load read racily, as heartbeats do)."""
        load = backend.engine.load()
        return {
            "role": "engine",
            "id": "in-process",
            "model": self.core.info.model_id,
            "running": load["running"],
            "waiting": load["waiting"],
            "free_kv_blocks": load["free_blocks"],
            "total_kv_blocks": load["total_blocks"],
            "inflight": self.core.inflight,
            "heartbeat_age_s": 0.0,
            "state": "serving" if backend.engine.alive else "gone",
        }
