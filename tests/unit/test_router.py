"""The gateway's router on a registry fed with heartbeats by hand: bursts spread, limits
give RESOURCE_EXHAUSTED, the breaker skips and forgives, policies keep their promises."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.config import GatewayConfig
from gateway.events import BackendError
from gateway.policies import RouteHint, block_hashes
from gateway.router import Router
from protos.epd_pb import bus_pb2
from services.bus.heartbeat import InstanceRegistry


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _router(ids=("d0", "d1"), clock=None, model="m", **api) -> Router:
    clock = clock or Clock()
    registry = InstanceRegistry(None, ["decode", "prefill"], expiry_s=1e9, clock=clock)
    for iid in ids:
        beat(registry, iid)
    return Router(registry, model, GatewayConfig(**api), clock=clock, rng=random.Random(0))


def beat(registry, iid, role="decode", running=0, draining=False, model="m") -> None:
    registry.record(
        bus_pb2.Heartbeat(
            role=role, instance_id=iid, running=running, draining=draining, model=model
        )
    )


@pytest.mark.parametrize("policy", ["least_loaded", "prefix_aware", "power_of_two"])
def test_a_burst_between_heartbeats_spreads_evenly(policy):
    router = _router(router_policy=policy)
    picks = Counter(router.pick("decode").instance_id for _ in range(16))
    assert sorted(picks.values()) in ([8, 8], [7, 9])


def test_leases_count_until_released():
    router = _router(ids=("d0",))
    a, b = router.pick("decode"), router.pick("decode")
    assert router.inflight("decode", "d0") == 2
    a.release()
    a.release()  # idempotent
    assert router.inflight("decode", "d0") == 1
    b.release()
    assert router.inflight("decode", "d0") == 0


def test_full_instances_give_resource_exhausted_then_recover():
    router = _router(max_inflight_per_instance=2)
    leases = [router.pick("decode") for _ in range(4)]
    with pytest.raises(BackendError) as err:
        router.pick("decode")
    assert err.value.code == "RESOURCE_EXHAUSTED"
    leases[0].release()
    assert router.pick("decode").instance_id == leases[0].instance_id


def test_heartbeat_load_of_other_gateways_counts():
    router = _router(router_policy="least_loaded")
    beat(router.registry, "d0", running=5)  # another gateway's work
    assert [router.pick("decode").instance_id for _ in range(5)] == ["d1"] * 5


def test_breaker_skips_a_failing_instance_for_its_cooloff():
    clock = Clock()
    router = _router(
        clock=clock, router_policy="round_robin", breaker_failures=3, breaker_cooloff_s=10
    )
    for _ in range(3):
        router.failed("decode", "d0")
    assert {router.pick("decode").instance_id for _ in range(6)} == {"d1"}
    clock.t = 11.0
    assert "d0" in {router.pick("decode").instance_id for _ in range(6)}
    router.succeeded("decode", "d0")
    router.failed("decode", "d0")  # one failure after a success does not open it
    assert "d0" in {router.pick("decode").instance_id for _ in range(6)}


def test_excluded_draining_and_foreign_instances_are_never_picked():
    router = _router(ids=("d0", "d1", "d2"))
    beat(router.registry, "d1", draining=True)
    beat(router.registry, "d2", model="other")
    assert {router.pick("decode").instance_id for _ in range(6)} == {"d0"}
    with pytest.raises(BackendError) as err:
        router.pick("decode", exclude={"d0"})
    assert err.value.code == "UNAVAILABLE"


def test_consistent_hash_keeps_sessions_and_moves_only_the_lost_ones():
    four = _router(ids=("d0", "d1", "d2", "d3"), router_policy="consistent_hash")
    other_gateway = _router(ids=("d0", "d1", "d2", "d3"), router_policy="consistent_hash")
    keys = [f"user-{i}" for i in range(200)]
    placed = {k: four.pick("decode", hint=RouteHint(k)).instance_id for k in keys}
    assert placed == {k: other_gateway.pick("decode", hint=RouteHint(k)).instance_id for k in keys}
    assert len(set(placed.values())) == 4
    after = {k: four.pick("decode", exclude={"d3"}, hint=RouteHint(k)).instance_id for k in keys}
    moved = [k for k in keys if after[k] != placed[k]]
    assert moved and all(placed[k] == "d3" for k in moved)


def test_prefix_aware_follows_the_prefix_within_the_balance_slack():
    router = _router(router_policy="prefix_aware")
    shared = list(range(100, 164))  # four 16-token blocks
    first = router.pick("decode", hint=RouteHint("", block_hashes(shared, 16)))
    for i in range(4):  # same prefix, different tails: same instance, up to the slack
        tail = shared + [i] * 20
        lease = router.pick("decode", hint=RouteHint("", block_hashes(tail, 16)))
        assert lease.instance_id == first.instance_id
    # Now 5 in flight there and 0 on the other: past the slack of 4, balance wins.
    lease = router.pick("decode", hint=RouteHint("", block_hashes(shared, 16)))
    assert lease.instance_id != first.instance_id


def test_block_hashes_chain_over_full_blocks_only():
    a, b = block_hashes(list(range(40)), 16), block_hashes(list(range(32)) + [7] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert block_hashes([9] + list(range(1, 40)), 16)[1] != a[1]  # chained from the parent


def test_total_silence_is_a_stall_here_until_three_expiries():
    """A gateway whose event loop was blocked hears no heartbeat at all: it must not
    expire the whole fleet the moment it wakes up; one silent instance among talking
    ones expires as usual; a fleet silent for 3 expiries is gone."""
    clock = Clock()
    registry = InstanceRegistry(None, ["decode"], expiry_s=3.0, clock=clock)
    beat(registry, "d0")
    beat(registry, "d1")
    clock.t = 5.0  # blocked for 5 s: nothing read
    assert [i.instance_id for i in registry.live("decode")] == ["d0", "d1"]
    beat(registry, "d0")  # heartbeats read again: d1 really is silent
    assert [i.instance_id for i in registry.live("decode")] == ["d0"]
    clock.t = 5.0 + 9.5
    assert registry.live("decode") == []


def test_a_draining_instance_handing_work_back_is_not_a_fault():
    router = _router(breaker_failures=1, router_policy="round_robin")
    lease = router.pick("decode")
    beat(router.registry, lease.instance_id, draining=True)
    lease.failed()  # its hand-back at the drain deadline
    assert router.inflight("decode", lease.instance_id) == 0
    assert not router._is_open("decode", lease.instance_id)
    other = router.pick("decode")
    other.failed()  # a real failure opens the breaker at once (breaker_failures=1)
    assert router._is_open("decode", other.instance_id)
