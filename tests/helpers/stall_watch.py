"""What the gateway's stall check reads, for tests of it: a registry clock the test moves,
and the fleet link's answers about a worker (gateway/fleet_link.py) from a real
InstanceRegistry."""

from __future__ import annotations

import time

from services.bus.heartbeat import InstanceRegistry


class Clock:
    """The registry's clock, set by the test; in step with time.monotonic (what the
    attempt measures silence with) but for an offset."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Watch:
    """The fleet link's answers (gateway/fleet_link.py), from a real registry."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self.registry = registry

    def alive(self, role: str, instance_id: str) -> bool:
        return any(i.instance_id == instance_id for i in self.registry.live(role))

    def progressed_at(self, role: str, instance_id: str) -> float | None:
        return self.registry.progressed_at(role, instance_id)

    async def answers_ping(self, role: str, instance_id: str) -> bool:
        return True
