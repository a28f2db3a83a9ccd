"""Our engine against transformers on tiny random checkpoints: greedy tokens identical,
top-5 raw logprobs within 1e-3 (fp32) — also with prefix-cache hits, chunked prefill,
preemption by recompute, and image prompts."""

from __future__ import annotations

import random

import pytest
import torch

from services import LLM, SamplingParams
from tests.helpers.checkpoints import (
    GEMMA_ARCHS,
    MOE_ARCHS,
    TEXT_ARCHS,
    make_llava_checkpoint,
    make_text_checkpoint,
    random_image,
)
from tests.helpers.reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

MAX_NEW = 12


def _prompts(n=4, lengths=(5, 17, 33, 50), seed=0):
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, 30000) for _ in range(lengths[i % len(lengths)])] for i in range(n)
    ]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


def _check(outs, refs):
    for out, (ref_ids, ref_top) in zip(outs, refs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ref_ids
        for ours, theirs in zip(comp.logprobs, ref_top, strict=False):
            for tid, lp in theirs:
                assert tid in ours, "top-5 token missing from our top-5"
                assert abs(ours[tid].logprob - lp) < 1e-3


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5, **kw)


@pytest.fixture
def threads(request):
    """Torch's thread count for the test (None: leave it); one thread lets the cpu backend
    run whole decode steps natively (``decode_stack``)."""
    old = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize(
    "backend,threads",
    [("cpu", None), ("cpu", 1), ("torch", None)],
    ids=["cpu", "cpu-1-thread", "torch"],
    indirect=["threads"],
)
@pytest.mark.parametrize("kind", TEXT_ARCHS + GEMMA_ARCHS + MOE_ARCHS)
def test_text_greedy_matches_transformers(kind, backend, threads, ckpt_root):
    path = make_text_checkpoint(ckpt_root, kind)
    prompts = _prompts()
    hf = load_hf(path)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), block_size=4, num_kv_blocks=256, attention_backend=backend)
    assert llm.engine.backend.name == backend
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), refs)
    # Second pass: the prompts now hit the prefix cache and must not change the tokens.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check(again, refs)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert llm.engine.block_manager.prefix_hit_tokens > 0
    # Without logprobs a greedy step takes the head's argmax directly (greedy_head).
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW),
    )
    assert [o.outputs[0].token_ids for o in plain] == [ids for ids, _ in refs]
    # Multi-step scheduling: after the prefill step, bursts of 4 decode steps (on the cpu
    # backend in one native call), alone and in a batch.
    llm.engine.config.num_scheduler_steps = 4
    for batch in (prompts[:1], prompts):
        burst = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            SamplingParams(temperature=0, max_tokens=MAX_NEW),
        )
        assert [o.outputs[0].token_ids for o in burst] == [ids for ids, _ in refs[: len(batch)]]


def test_chunked_prefill_and_shared_prefixes(ckpt_root):
    path = make_text_checkpoint(ckpt_root, "llama")
    base = _prompts(1, (40,), seed=3)[0]
    prompts = [base + p for p in _prompts(4, (3, 9, 1, 14), seed=4)]
    hf = load_hf(path)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), block_size=4, num_kv_blocks=256, max_num_batched_tokens=7)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), refs)


def test_preemption_by_recompute(ckpt_root):
    path = make_text_checkpoint(ckpt_root, "qwen2")
    prompts = _prompts(6, (20, 31, 9, 26), seed=5)
    hf = load_hf(path)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    # 24 blocks of 4 tokens cannot hold all six sequences at once.
    llm = LLM(str(path), block_size=4, num_kv_blocks=24)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), refs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


def test_sharded_checkpoint_loads_identically(ckpt_root):
    path = make_text_checkpoint(ckpt_root, "llama", shards=True)
    assert (path / "model.safetensors.index.json").exists()
    prompts = _prompts(2)
    hf = load_hf(path)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), block_size=8, num_kv_blocks=64)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), refs)


def _llava_inputs(path, n_images, hf):
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    image_id = tok.convert_tokens_to_ids("<image>")
    tpi = _tokens_per_image(hf)
    rng = random.Random(n_images)
    ids = [tok.cls_token_id]
    for _ in range(n_images):
        ids += [rng.randrange(1000, 30000) for _ in range(3)] + [image_id]
    ids += [rng.randrange(1000, 30000) for _ in range(5)]
    images = [random_image(i + 10 * n_images) for i in range(n_images)]
    expanded = [t for x in ids for t in ([x] * tpi if x == image_id else [x])]
    proc = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    pixels = proc(images=images, return_tensors="pt")["pixel_values"]
    return ids, images, expanded, pixels


def _tokens_per_image(hf):
    vc = hf.config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2 + (1 if vc.model_type.startswith("clip") else 0)
    return n - 1 if hf.config.vision_feature_select_strategy == "default" else n


@pytest.mark.parametrize(
    "vision,text,strategy,layer",
    [("clip", "llama", "default", -2), ("siglip", "qwen2", "full", [-3, -1])],
)
def test_llava_image_prompts_match_transformers(vision, text, strategy, layer, ckpt_root):
    path = make_llava_checkpoint(ckpt_root, vision, text, strategy=strategy, feature_layer=layer)
    hf = load_hf(path)
    llm = LLM(str(path), block_size=4, num_kv_blocks=256)
    for n_images in (1, 3):
        ids, images, expanded, pixels = _llava_inputs(path, n_images, hf)
        ref = hf_greedy(hf, expanded, MAX_NEW, pixel_values=pixels)
        out = llm.generate({"prompt_token_ids": ids, "images": images}, _greedy())
        assert out[0].prompt_token_ids == expanded
        _check(out, [ref])
