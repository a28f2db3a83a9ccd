"""Bad checkpoints and bad requests raise a ValueError that names the problem, and a bad
request leaves the requests already in the engine exactly as they would be without it."""

from __future__ import annotations

import io
import json
import random
import shutil

import pytest
from safetensors.torch import load_file, save_file

from services import LLM, SamplingParams
from services.models.loader import CheckpointError
from services.models.registry import UnsupportedModelError
from tests.helpers.checkpoints import random_image


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(llama_ckpt) -> LLM:
    # A 128-token context over a pool of 24 blocks of 4 (96 KV slots).
    return LLM(str(llama_ckpt), block_size=4, num_kv_blocks=24, max_model_len=128)


# ----------------------------------------------------------------- checkpoints


def _variant(src, tiny_root, name: str, change) -> str:
    path = tiny_root / f"bad-{name}"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(src, path)
    change(path)
    return str(path)


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(path):
    (path / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))


def _drop_a_weight(path):
    f = path / "model.safetensors"
    weights = load_file(str(f))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(f))


def _unknown_arch(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))


BAD_CHECKPOINTS = [
    (
        "unknown-arch",
        _unknown_arch,
        UnsupportedModelError,
        "unsupported architecture ['FooForCausalLM']",
    ),
    ("truncated", _truncate, CheckpointError, "cannot read weights from model.safetensors"),
    ("garbage", _garbage, CheckpointError, "cannot read weights from model.safetensors"),
    (
        "no-weights",
        lambda p: (p / "model.safetensors").unlink(),
        CheckpointError,
        "no *.safetensors weights",
    ),
    ("missing-weight", _drop_a_weight, CheckpointError, "layers.1.mlp.down_proj.weight"),
    ("no-config", lambda p: (p / "config.json").unlink(), CheckpointError, "no config.json"),
    (
        "bad-config",
        lambda p: (p / "config.json").write_text("{oops"),
        CheckpointError,
        "config.json is not valid JSON",
    ),
]


@pytest.mark.parametrize("name,change,error,message", BAD_CHECKPOINTS)
def test_bad_checkpoint_raises_a_clear_error(llama_ckpt, tiny_root, name, change, error, message):
    path = _variant(llama_ckpt, tiny_root, name, change)
    with pytest.raises(error) as info:
        LLM(path, block_size=4, num_kv_blocks=16)
    assert isinstance(info.value, ValueError) and message in str(info.value)


# ----------------------------------------------------------------- requests

BAD_PROMPTS = [
    ("", "prompt is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": _ids(200)}, "prompt is 200 tokens"),
    ({"prompt_token_ids": _ids(128)}, "context of 128 tokens"),
    ({"prompt_token_ids": [5, 30523, 7]}, "integers in [0, 30523)"),
    ({"prompt_token_ids": [5, -1]}, "integers in [0, 30523)"),
    ({"prompt_token_ids": [5, 7.5]}, "integers in [0, 30523)"),
    ({"prompt_token_ids": [5, 7], "images": [random_image(0)]}, "does not accept images"),
    (["not", "a", "prompt"], "a prompt is a string or a dict"),
    ({"text": "hi"}, "needs 'prompt' (str) or 'prompt_token_ids'"),
]


@pytest.mark.parametrize("prompt,message", BAD_PROMPTS)
def test_bad_prompt_raises_a_clear_error(llm, prompt, message):
    with pytest.raises(ValueError) as info:
        llm.engine.add_request("bad", prompt, SamplingParams(max_tokens=4))
    assert message in str(info.value)
    assert "bad" not in llm.engine.states


def test_max_tokens_beyond_the_kv_pool_is_rejected_without_leftovers(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="may need .* KV blocks"):
        engine.add_request("big", {"prompt_token_ids": _ids(10)}, SamplingParams(max_tokens=100))
    # Nothing of it is left behind: the id is free again.
    assert "big" not in engine.states and "big" not in engine.runner.seeds
    engine.add_request("big", {"prompt_token_ids": _ids(10)}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_non_positive_max_tokens_is_rejected(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=max_tokens)


@pytest.fixture(scope="module")
def llava(llava_ckpt) -> LLM:
    return LLM(str(llava_ckpt), block_size=4, num_kv_blocks=128)


def _image_prompt(llava: LLM, n_placeholders: int) -> list[int]:
    image_id = llava.tokenizer.convert_tokens_to_ids("<image>")
    return [101] + [image_id, 2000] * n_placeholders + [2001]


def test_image_count_mismatch_is_rejected(llava):
    prompt = {"prompt_token_ids": _image_prompt(llava, 2), "images": [random_image(1)]}
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        llava.engine.add_request("mm", prompt, SamplingParams(max_tokens=2))
    prompt = {"prompt_token_ids": _image_prompt(llava, 0), "images": [random_image(1)]}
    with pytest.raises(ValueError, match="0 image placeholders but 1 images"):
        llava.engine.add_request("mm", prompt, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("data", [b"\x89PNG\r\n\x1a\n not really", b"", "a-url-string"])
def test_undecodable_image_is_rejected(llava, data):
    prompt = {"prompt_token_ids": _image_prompt(llava, 1), "images": [data]}
    with pytest.raises(ValueError, match="image"):
        llava.engine.add_request("mm", prompt, SamplingParams(max_tokens=2))
    assert "mm" not in llava.engine.states


def test_png_bytes_are_accepted(llava):
    """The counterpart of the rejections above: real encoded bytes do decode."""
    buf = io.BytesIO()
    random_image(2).save(buf, format="PNG")
    prompt = {"prompt_token_ids": _image_prompt(llava, 1), "images": [buf.getvalue()]}
    out = llava.generate(prompt, SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


# ----------------------------------------------------------------- isolation


GOOD = [
    (_ids(9, 1), SamplingParams(temperature=0, max_tokens=10)),
    (_ids(17, 2), SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=10)),
    (_ids(5, 3), SamplingParams(temperature=1.0, max_tokens=10)),  # seed drawn by the engine
]
LATE = (_ids(6, 4), SamplingParams(temperature=1.0, max_tokens=6))  # added after the bad ones

BAD_REQUESTS = [
    ("r0", {"prompt_token_ids": [1]}),  # duplicate id of a running request
    ("x1", {"prompt_token_ids": _ids(300)}),
    ("x2", ""),
    ("x3", {"prompt_token_ids": [99999]}),
    ("x4", {"prompt_token_ids": [5], "images": [b"junk"]}),
]


def _run(llama_ckpt, with_bad: bool) -> dict[str, list[int]]:
    engine = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=24, max_model_len=128).engine
    for i, (ids, sp) in enumerate(GOOD):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, sp)
    tokens: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids

    for _ in range(2):  # the good requests are running when the bad ones arrive
        step()
    if with_bad:
        for rid, prompt in BAD_REQUESTS:
            with pytest.raises(ValueError):
                engine.add_request(rid, prompt, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="may need"):  # rejected by the scheduler
            engine.add_request("x5", {"prompt_token_ids": _ids(8)}, SamplingParams(max_tokens=100))
    engine.add_request("late", {"prompt_token_ids": LATE[0]}, LATE[1])
    while engine.has_unfinished_requests():
        step()
    assert not engine.states and engine.block_manager.num_free_blocks == 24
    return tokens


def test_bad_requests_leave_running_requests_unchanged(llama_ckpt):
    clean, dirty = _run(llama_ckpt, False), _run(llama_ckpt, True)
    assert set(dirty) == {"r0", "r1", "r2", "late"}
    assert all(len(t) >= 6 for t in dirty.values())
    assert dirty == clean
