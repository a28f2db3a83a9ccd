"""The one-command local stack, as a user runs it: `epd up` starts NATS, Redis and every
service as processes; a real gRPC client gets an answer (with an image); SIGTERM stops
everything cleanly."""

from __future__ import annotations

import io

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
