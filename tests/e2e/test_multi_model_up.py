"""`epd up --model demo --model <qwen2>`: two models (a vision-language demo model and a
Qwen2 text model) on one local fleet behind one gateway, as a user starts them. Both are
listed; each answers with the tokens it gives when run alone; an unknown model is 404."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pbg
from services import LLM, SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 23, 42, 8, 99, 3, 64, 12]
TOKENS = 6


def _alone(model: str, demo_dir) -> list[int]:
    llm = LLM(model=model, demo_dir=str(demo_dir), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids)


def _listed(base: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]


def test_epd_up_serves_two_models(demo_dir, tmp_path):
    qwen = make_text_checkpoint(tmp_path, "qwen2")
    want = {"demo": _alone("demo", demo_dir), "qwen2-0": _alone(str(qwen), demo_dir)}
    running = epd_up(demo_dir, "--model", "demo", "--model", str(qwen), ready_s=400)
    try:
        deadline = time.monotonic() + 120  # health says one model serves; wait for both
        while _listed(running.base_url) != ["demo", "qwen2-0"]:
            assert time.monotonic() < deadline, _listed(running.base_url)
            time.sleep(0.5)
        fingerprints = set()
        with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as ch:
            stub = pbg.InferenceStub(ch)
            for model, tokens in want.items():
                sp = pb.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
                req = pb.GenerateRequest(
                    model=model, prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=sp
                )
                out = stub.GenerateOnce(req, timeout=120)
                assert (out.model, list(out.token_ids)) == (model, tokens)
                body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
                r = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200 and r.json()["model"] == model, r.text
                fingerprints.add(r.json()["system_fingerprint"])
        assert len(fingerprints) == 2
        missing = httpx.post(
            f"{running.base_url}/v1/completions",
            timeout=30,
            json={"model": "gpt-4", "prompt": "hi"},
        )
        assert missing.status_code == 404
    finally:
        output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]
    assert "epd-serve is up: models 'demo', 'qwen2-0'" in output
