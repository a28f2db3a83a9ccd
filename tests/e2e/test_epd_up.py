"""The one-command local stack, as a user runs it: `epd up` starts NATS, Redis and every
service as processes; a real gRPC client gets an answer (with an image); SIGTERM stops
everything cleanly."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import grpc
import pytest

from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services.localstack import free_port
from services.stack import wait_for_grpc
from tests.helpers.checkpoints import random_image

pytestmark = pytest.mark.slow


def test_epd_up_serves_and_stops_cleanly(tmp_path):
    grpc_port, nats_port, redis_port = free_port(), free_port(), free_port()
    env = dict(os.environ, EPD_DEMO_DIR=str(tmp_path / "demo"))
    argv = [sys.executable, "-m", "services.cli", "up", "--grpc-port", str(grpc_port),
            "--nats-url", f"nats://127.0.0.1:{nats_port}",
            "--redis-url", f"redis://127.0.0.1:{redis_port}/0"]  # fmt: skip
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_grpc(grpc_port, timeout_s=240)
        buf = io.BytesIO()
        random_image(1).save(buf, format="PNG")
        msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(image=buf.getvalue()),
                                                 pb.ContentPart(text="what is this?")])  # fmt: skip
        req = pb.GenerateRequest(model="demo", chat=pb.Chat(messages=[msg]),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=5))  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            out = pbg.InferenceStub(ch).GenerateOnce(req, timeout=60)
        assert len(out.token_ids) == 5 and out.usage.prompt_tokens > 16
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
