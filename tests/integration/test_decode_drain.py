"""SIGTERM to a decode process in the middle of 8 streams: it announces draining, takes
no new work, lets every stream finish within its grace, and exits 0. The decode runs
as `epd serve decode` (a real process, real signal); prefill and the gateway run here."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from prefill_svc.service import PrefillService
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.config import EngineConfig
from tests.integration.stack import service_config, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

ROOT = Path(__file__).resolve().parents[2]
STREAMS, MAX_TOKENS = 8, 400


def _spawn_decode(engine: EngineConfig, nats_url: str, redis_url: str, iid: str, log: Path):
    env = dict(
        os.environ,
        EPD_MODEL="demo",
        EPD_DEMO_DIR=engine.demo_dir,
        EPD_NUM_KV_BLOCKS=str(engine.num_kv_blocks),
        EPD_HEARTBEAT_S="0.2",
        EPD_SHUTDOWN_GRACE_S="60",
    )
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "serve",
        "decode",
        "--nats-url",
        nats_url,
        "--redis-url",
        redis_url,
        "--instance-id",
        iid,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _request(i: int) -> pb.GenerateRequest:
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=f"count to a thousand, {i}")])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(chat=pb.Chat(messages=[msg]), sampling=sp)


async def _stream(stub, i: int, counts: list[int], started: asyncio.Event, n_started: list[int]):
    """Count stream ``i``'s tokens; ``started`` once every stream has two (decode owns
    them all: token 1 comes from prefill)."""
    async for resp in stub.Generate(_request(i), timeout=120):
        before = counts[i]
        counts[i] += len(resp.token_ids)
        if before < 2 <= counts[i]:
            n_started[0] += 1
            if n_started[0] == STREAMS:
                started.set()
    return counts[i]


async def test_sigterm_mid_streams_lets_all_streams_finish(tmp_path, nats_server, redis_server):
    engine = EngineConfig(model="demo", demo_dir=str(tmp_path / "demo"), num_kv_blocks=512)
    cfg = lambda name: service_config(nats_server.url, redis_server.url, name)  # noqa: E731
    prefill = PrefillService(engine, cfg("prefill-drain"))
    await prefill.start()  # generates the demo checkpoint before the decode process reads it
    log = tmp_path / "decode.log"
    proc = _spawn_decode(engine, nats_server.url, redis_server.url, "decode-drain", log)
    gw = await start_gateway(engine, cfg("gateway-drain"), aggregated=False)
    registry = gw.core.backend.registry

    def decode_state() -> str:
        for info in registry.live("decode", include_draining=True):
            if info.instance_id == "decode-drain":
                return "draining" if info.load.draining else "serving"
        return "gone"

    try:
        await registry.wait_for(lambda: decode_state() == "serving", timeout_s=120)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}")
        stub = pbg.InferenceStub(channel)
        counts, started, n_started = [0] * STREAMS, asyncio.Event(), [0]
        streams = [
            asyncio.create_task(_stream(stub, i, counts, started, n_started))
            for i in range(STREAMS)
        ]
        await asyncio.wait_for(started.wait(), timeout=120)
        at_signal = list(counts)
        proc.send_signal(signal.SIGTERM)
        await registry.wait_for(lambda: decode_state() == "draining", timeout_s=10)
        finals = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
        assert finals == [MAX_TOKENS] * STREAMS, log.read_text()[-3000:]
        # Not vacuous: the streams were mid-way when the signal went out.
        assert sum(at_signal) < STREAMS * MAX_TOKENS
        exit_code = await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout=30)
        assert exit_code == 0, log.read_text()[-3000:]
        await channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        await gw.stop()
        await prefill.stop()
