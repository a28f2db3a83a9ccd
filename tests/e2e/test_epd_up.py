"""The one-command local stack, as a user runs it: `epd up` starts NATS, Redis and every
service as processes; a real gRPC client gets an answer (with an image); SIGTERM stops
everything cleanly; Ctrl-C (SIGINT) too, leaving no process and no temporary folder."""

from __future__ import annotations

import base64
import io
import signal
from pathlib import Path

import grpc
import openai
import pytest

from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from tests.helpers.checkpoints import random_image
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow


def test_epd_up_with_credentials_serves_openai_and_grpc_and_stops_cleanly(demo_dir):
    """NATS with user/password and Redis with a password, as `epd up` starts them: every
    service authenticates; the official openai client gets a chat answer about an image;
    the passwords never reach the output."""
    nats_pw, redis_pw = "nats-Secret-7", "redis-Secret-9"
    running = epd_up(demo_dir, nats_userinfo=f"epd:{nats_pw}", redis_password=redis_pw)
    try:
        buf = io.BytesIO()
        random_image(1).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="demo",
            max_tokens=5,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
        )
        assert chat.usage.completion_tokens == 5 and chat.usage.prompt_tokens > 16
        msg = pb.ChatMessage(
            role="user",
            parts=[pb.ContentPart(image=buf.getvalue()), pb.ContentPart(text="what is this?")],
        )
        req = pb.GenerateRequest(
            model="demo",
            chat=pb.Chat(messages=[msg]),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=5),
        )
        with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as ch:
            out = pbg.InferenceStub(ch).GenerateOnce(req, timeout=60)
        assert list(out.token_ids)[:5] and out.usage.prompt_tokens > 16
        _assert_refused_without_credentials(running)
    finally:
        output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]
    assert "OpenAI REST  http://127.0.0.1:" in output
    assert nats_pw not in output and redis_pw not in output


def _assert_refused_without_credentials(running) -> None:
    """The servers `epd up` started really require the credentials."""
    import asyncio

    import nats
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(running.redis_url).ping()

    async def anonymous() -> None:
        nc = await nats.connect(
            running.nats_url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False
        )
        await nc.close()

    with pytest.raises(Exception, match="(?i)authoriz"):
        asyncio.run(anonymous())


def _children(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (services, nats-server, redis-server)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ctrl_c_stops_everything_and_leaves_no_process_or_temp_dir(demo_dir, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    running = epd_up(demo_dir, env={"TMPDIR": str(tmp)})
    children = _children(running.proc.pid)
    # every service (5 without --aggregated: encoder, prefill, cache, decode, gateway),
    # nats-server and redis-server
    assert len(children) >= 7, children
    assert any(p.name.startswith("epd-") for p in tmp.iterdir())  # NATS / Redis workdirs
    running.proc.send_signal(signal.SIGINT)
    output = running.stop(timeout_s=120)  # waits; SIGTERM only if still running
    assert running.proc.returncode == 0, output[-3000:]
    assert [pid for pid in children if _alive(pid)] == []
    assert [p.name for p in tmp.iterdir() if p.name.startswith("epd-")] == []
    # the one block printed when everything was healthy
    assert f"dashboard    http://127.0.0.1:{running.http_port}/dashboard" in output
    assert f"metrics      http://127.0.0.1:{running.http_port}/metrics" in output
    assert output.count("/metrics   (") == 5  # the gateway's and each worker's port
