"""A fleet that loses nothing, with real worker processes killed by SIGKILL.

Workers run as ``epd serve prefill|decode`` processes on real NATS and Redis; the
gateway runs here so its router can be inspected. Every request's tokens are checked
against the same request run undisturbed (greedy: identical)."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import pytest_asyncio

from gateway.config import GatewayConfig
from protos.epd_pb import inference_pb2 as pb
from services.bus import subjects
from services.config import EngineConfig
from services.metrics import MIGRATIONS
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.fleet import ProcessFleet, fail_message, kill_the_holder, text_fleet_env
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

STREAMS, TOKENS = 16, 200


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, nats_server, redis_server):
    ckpt = make_text_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")
    logs = tmp_path_factory.mktemp("logs")
    f = ProcessFleet(str(ckpt), nats_server.url, redis_server.url, logs, text_fleet_env(ckpt))
    for iid in ("p0", "p1", "d0", "d1"):
        f.spawn(subjects.ROLE_PREFILL if iid[0] == "p" else subjects.ROLE_DECODE, iid)
    yield f
    f.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def gateway_factory(fleet, nats_server, redis_server):
    gateways, channels = [], []

    async def start(policy: str, **api):
        engine = EngineConfig(model=fleet.model)
        cfg = service_config(nats_server.url, redis_server.url, f"gw-{len(gateways)}")
        gw = await start_gateway(
            engine,
            cfg,
            aggregated=False,
            api=GatewayConfig(http_port=0, router_policy=policy, **api),
        )
        gateways.append(gw)
        await _wait_for_workers(gw, fleet)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        channels.append(channel)
        from protos.epd_pb import inference_pb2_grpc as pbg

        return gw, pbg.InferenceStub(channel)

    yield start
    for ch in channels:
        await ch.close()
    for gw in gateways:
        await gw.stop()


async def _wait_for_workers(gw, fleet: ProcessFleet) -> None:
    """Every worker of the fleet that is still running is live in the gateway's router."""
    router = gw.core.backend.router
    want = {(w.role, w.instance_id) for w in fleet.workers if w.proc.poll() is None}

    def ready() -> bool:
        return want <= {(r, i.instance_id) for r in ("prefill", "decode") for i in router.live(r)}

    try:
        await gw.core.backend.registry.wait_for(ready, timeout_s=180)
    except TimeoutError:
        pytest.fail(f"workers never came up:\n{fail_message(fleet)}")


def _request(i: int, tokens: int = TOKENS, words: int = 8) -> pb.GenerateRequest:
    text = f"request {i}: " + " ".join(f"w{i}x{j}" for j in range(words))
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=text)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def _reference(stub, reqs) -> list[list[int]]:
    outs = await asyncio.gather(*(stub.GenerateOnce(r, timeout=120) for r in reqs))
    return [list(o.token_ids) for o in outs]


async def _streams(stub, reqs, on_all_started=None, metadata=()) -> list[list[int]]:
    """Run every request as a stream; ``on_all_started()`` once each has 20 tokens."""
    got: list[list[int]] = [[] for _ in reqs]
    started = asyncio.Event()

    async def one(i: int) -> None:
        async for resp in stub.Generate(reqs[i], timeout=120, metadata=metadata):
            got[i] += resp.token_ids
            if len(got[i]) >= 20 and all(len(g) >= 20 for g in got):
                started.set()

    async def trigger() -> None:
        await started.wait()
        if on_all_started is not None:
            await on_all_started()

    trig = asyncio.create_task(trigger())
    await asyncio.gather(*(one(i) for i in range(len(reqs))))
    if trig.done():
        trig.result()  # the trigger's own failure, if any
    trig.cancel()
    return got


def _decode_load(gw) -> dict[str, int]:
    router = gw.core.backend.router
    return {i.instance_id: router.inflight("decode", i.instance_id) for i in router.live("decode")}


async def test_a_burst_of_16_streams_splits_evenly_over_two_decodes(gateway_factory):
    gw, stub = await gateway_factory("prefix_aware")
    seen: dict[str, int] = {}

    async def look() -> None:
        seen.update(_decode_load(gw))

    reqs = [_request(i) for i in range(STREAMS)]
    await _streams(stub, reqs, look)
    assert sorted(seen.values()) in ([8, 8], [7, 9]), seen


async def test_kill9_of_the_decode_serving_16_streams_loses_none(gateway_factory, fleet):
    # consistent_hash on one session key puts all 16 on one decode, as in the field report
    gw, stub = await gateway_factory("consistent_hash")
    reqs = [_request(100 + i) for i in range(STREAMS)]
    reference = await _reference(stub, reqs)
    before = MIGRATIONS.labels("decode", "migration")._value.get()
    victims = []

    async def kill_the_busy_one() -> None:
        load = _decode_load(gw)
        busy = max(load, key=load.get)
        assert load[busy] == STREAMS, load
        victims.append(next(w for w in fleet.workers if w.instance_id == busy))
        victims[0].kill()

    got = await _streams(stub, reqs, kill_the_busy_one, metadata=(("x-session-id", "s1"),))
    assert victims, "the kill never happened"
    assert got == reference  # 16 of 16, no token missing, repeated or changed
    assert MIGRATIONS.labels("decode", "migration")._value.get() - before == STREAMS


async def test_requests_right_after_a_death_all_succeed(gateway_factory, fleet):
    fleet.spawn(subjects.ROLE_DECODE, "d2")
    fleet.spawn(subjects.ROLE_DECODE, "d3")
    gw, stub = await gateway_factory("round_robin")
    reqs = [_request(200 + i, tokens=16) for i in range(8)]
    reference = await _reference(stub, reqs)
    victim = next(w for w in fleet.workers if w.instance_id == "d2")
    victim.kill()  # its heartbeat has not expired yet: the router still lists it
    assert "d2" in _decode_load(gw)
    outs = await _reference(stub, reqs)
    assert outs == reference


async def test_kill9_of_a_prefill_holding_a_request_is_retried(gateway_factory, fleet):
    gw, stub = await gateway_factory("round_robin")
    req = _request(300, tokens=32, words=40)
    reference = (await _reference(stub, [req]))[0]
    prefills = [w for w in fleet.workers if w.role == "prefill" and w.proc.poll() is None]
    before = MIGRATIONS.labels("prefill", "retry")._value.get()
    call = await kill_the_holder(
        prefills, subjects.ROLE_PREFILL, gw, lambda: stub.GenerateOnce(req, timeout=120)
    )
    assert list((await call).token_ids) == reference
    assert MIGRATIONS.labels("prefill", "retry")._value.get() - before == 1


async def test_kill9_mid_constrained_streams_keeps_every_grammar(gateway_factory, fleet):
    """Constrained requests (over gRPC) migrate too: the new prefill and decode rebuild
    each matcher from the tokens already sent, so the output goes on under it."""
    gw, stub = await gateway_factory("consistent_hash")
    constraint = pb.StructuredOutputs(regex="[a-z]{240}")
    reqs = [_request(300 + i, tokens=120) for i in range(8)]
    for r in reqs:
        r.sampling.ignore_eos = False
        r.sampling.structured_outputs.CopyFrom(constraint)
    reference = await _reference(stub, reqs)
    victims = []

    async def kill_the_busy_one() -> None:
        load = _decode_load(gw)
        victims.append(next(w for w in fleet.workers if w.instance_id == max(load, key=load.get)))
        victims[0].kill()

    got = await _streams(stub, reqs, kill_the_busy_one, metadata=(("x-session-id", "s3"),))
    assert victims, "the kill never happened"
    assert got == reference
    texts = [(await stub.GenerateOnce(r, timeout=120)).text for r in reqs[:2]]
    assert all(re.fullmatch(r"[a-z]+", t) for t in texts), texts
