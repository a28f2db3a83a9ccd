"""Benchmark helper: worker processes (``epd serve prefill|decode``) on private NATS and
Redis, gateways in this process (their routers can be inspected and wrapped), and
streams timed token by token.

Workers come from tests/helpers/fleet.py (``kill()`` is SIGKILL); ``Rig.close()`` stops
gateways, workers and servers, and is safe to call twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway.config import GatewayConfig
from launch.localstack import ServerProcess, start_nats, start_redis
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from tests.helpers.fleet import ProcessFleet, Worker, fail_message, text_fleet_env
from tests.integration.stack import service_config, start_gateway

ROLES = {"p": "prefill", "d": "decode"}


@dataclass
class Timing:
    """Heartbeat period and instance expiry (workers and gateway alike), drain grace."""

    heartbeat_s: float = 1.0
    ttl_s: float = 3.0
    grace_s: float = 10.0


@dataclass
class Gw:
    """One in-process gateway, its channel, and every instance its router picked."""

    gateway: object
    channel: grpc.aio.Channel
    stub: pbg.InferenceStub
    picks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def router(self):
        return self.gateway.core.backend.router

    def load(self, role: str) -> dict[str, int]:
        return {
            i.instance_id: self.router.inflight(role, i.instance_id) for i in self.router.live(role)
        }


@dataclass
class Rig:
    """Private NATS + Redis, worker processes of one text checkpoint, gateways here."""

    model: str
    timing: Timing
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="epd-fleet-")))
    nats: ServerProcess | None = None
    redis: ServerProcess | None = None
    fleet: ProcessFleet | None = None
    gateways: list[Gw] = field(default_factory=list)

    def start(self, instance_ids: list[str], kv_blocks: int = 1024) -> None:
        self.nats, self.redis = start_nats(), start_redis(maxmemory="256mb")
        env = {
            **text_fleet_env(Path(self.model), kv_blocks),
            "EPD_HEARTBEAT_S": str(self.timing.heartbeat_s),
            "EPD_INSTANCE_TTL_S": str(self.timing.ttl_s),
            "EPD_SHUTDOWN_GRACE_S": str(self.timing.grace_s),
        }
        self.fleet = ProcessFleet(self.model, self.nats.url, self.redis.url, self.logdir, env)
        for iid in instance_ids:
            self.spawn(iid)

    def spawn(self, iid: str) -> Worker:
        """``p...`` is a prefill instance, ``d...`` a decode one."""
        return self.fleet.spawn(ROLES[iid[0]], iid)

    def worker(self, iid: str) -> Worker:
        return next(w for w in self.fleet.workers if w.instance_id == iid)

    def running(self, role: str) -> list[Worker]:
        return [w for w in self.fleet.workers if w.role == role and w.proc.poll() is None]

    def signal(self, iid: str, sig: signal.Signals) -> None:
        self.worker(iid).proc.send_signal(sig)

    async def gateway(self, policy: str, **api) -> Gw:
        """A fresh gateway with ``policy``; returns once every running worker is live in
        its router. Every ``router.pick`` is recorded in ``Gw.picks``."""
        cfg = service_config(self.nats.url, self.redis.url, f"gw-{len(self.gateways)}")
        cfg = dataclasses.replace(
            cfg,
            heartbeat_s=self.timing.heartbeat_s,
            instance_ttl_s=self.timing.ttl_s,
            request_timeout_s=300.0,
            stall_timeout_s=30.0,
            bus_timeout_s=30.0,
        )
        gw = await start_gateway(
            EngineConfig(model=self.model),
            cfg,
            aggregated=False,
            api=GatewayConfig(http_port=0, router_policy=policy, **api),
        )
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        g = Gw(gw, channel, pbg.InferenceStub(channel))
        self.gateways.append(g)
        _record_picks(g)
        await self.wait_live(g)
        return g

    async def wait_live(self, g: Gw, timeout_s: float = 300.0) -> None:
        """Every running worker is live (and serving) in ``g``'s router."""

        def ready() -> bool:
            want = {(w.role, w.instance_id) for w in self.fleet.workers if w.proc.poll() is None}
            have = {(r, i.instance_id) for r in ROLES.values() for i in g.router.live(r)}
            return want <= have

        try:
            await g.gateway.core.backend.registry.wait_for(ready, timeout_s=timeout_s)
        except TimeoutError:
            raise RuntimeError(f"workers never came up:\n{fail_message(self.fleet)}") from None

    async def wait_gone(self, g: Gw, iid: str, timeout_s: float = 60.0) -> None:
        """``iid`` has left ``g``'s registry (its heartbeats expired)."""
        reg = g.gateway.core.backend.registry

        def gone() -> bool:
            return all(
                i.instance_id != iid
                for r in ROLES.values()
                for i in reg.live(r, include_draining=True)
            )

        await reg.wait_for(gone, timeout_s=timeout_s)

    async def close_gateway(self, g: Gw) -> None:
        await g.channel.close()
        await g.gateway.stop()
        self.gateways.remove(g)

    async def close_gateways(self) -> None:
        for g in list(self.gateways):
            await self.close_gateway(g)

    def close(self) -> None:
        if self.fleet is not None:
            for w in self.fleet.workers:  # a frozen worker ignores SIGTERM
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGCONT)
            self.fleet.stop()
            self.fleet = None
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()
        self.redis = self.nats = None


def _record_picks(g: Gw) -> None:
    router = g.router
    pick = router.pick

    def recorded(role, **kw):
        lease = pick(role, **kw)
        g.picks.append((role, lease.instance_id))
        return lease

    router.pick = recorded


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    sent: float
    times: list[float] = field(default_factory=list)  # arrival of every token, in order
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def stall_after(self, t: float) -> float | None:
        """The longest wait between two tokens, the later one after ``t``: the stall of a
        migration (tokens already on their way at ``t`` still arrive after it, so the gap
        that straddles ``t`` is not the one to measure)."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False) if b > t]
        return max(gaps) if gaps else None


async def stream(
    stub,
    req: pb.GenerateRequest,
    metadata=(),
    timeout_s: float = 300.0,
    on_token=None,
    out: Stream | None = None,
) -> Stream:
    """Run ``req`` as a stream (into ``out`` when given, so a caller can watch it);
    ``on_token()`` after each response with tokens. A gRPC failure is recorded in
    ``Stream.error``, never raised."""
    s = out if out is not None else Stream(0.0)
    s.sent = time.perf_counter()
    try:
        async for resp in stub.Generate(req, timeout=timeout_s, metadata=metadata):
            if resp.token_ids:
                now = time.perf_counter()
                s.tokens += resp.token_ids
                s.times += [now] * len(resp.token_ids)
                if on_token is not None:
                    on_token()
            if resp.HasField("usage"):
                s.prompt_tokens = resp.usage.prompt_tokens
                s.cached_tokens = resp.usage.cached_tokens
    except grpc.aio.AioRpcError as e:
        s.error = f"{e.code().name}: {e.details()}"
    return s


def chat_request(messages: list[tuple[str, str]], max_tokens: int) -> pb.GenerateRequest:
    msgs = [pb.ChatMessage(role=r, parts=[pb.ContentPart(text=t)]) for r, t in messages]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=msgs), sampling=sp)


async def wait_until(pred, timeout_s: float, tick_s: float = 0.01) -> None:
    """Poll ``pred`` (for state only the client sees: token counts of its own streams)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(tick_s)


class LoopLag:
    """How late this event loop wakes a sleeper: the gateway under test shares it, so a
    stall here is a stall of the gateway (heartbeats read late, instances expired)."""

    def __init__(self, tick_s: float = 0.05):
        self.tick_s, self.worst, self.over_1s = tick_s, 0.0, 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            lag = time.perf_counter() - t - self.tick_s
            self.worst = max(self.worst, lag)
            self.over_1s += lag > 1.0
