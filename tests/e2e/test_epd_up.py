"""The one-command local stack, as a user runs it: `epd up` starts NATS, Redis and every
service as processes; a real gRPC client gets an answer (with an image); SIGTERM stops
everything cleanly; Ctrl-C (SIGINT) too, leaving no process and no temporary folder."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import grpc
import pytest

from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from tests.helpers.checkpoints import random_image
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow


def test_epd_up_serves_and_stops_cleanly(demo_dir):
    running = epd_up(demo_dir)
    try:
        buf = io.BytesIO()
        random_image(1).save(buf, format="PNG")
        msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(image=buf.getvalue()),
                                                 pb.ContentPart(text="what is this?")])  # fmt: skip
        req = pb.GenerateRequest(model="demo", chat=pb.Chat(messages=[msg]),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=5))  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as ch:
            out = pbg.InferenceStub(ch).GenerateOnce(req, timeout=60)
        assert len(out.token_ids) == 5 and out.usage.prompt_tokens > 16
    finally:
        output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]
    assert "OpenAI REST  http://127.0.0.1:" in output


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
