"""The offline API's shape: dtypes, generation_config defaults, prompt forms, chat."""

from __future__ import annotations

import json

import torch

from services import LLM, SamplingParams
from tests.helpers.checkpoints import random_image


def test_bf16_and_fp16_load_and_generate(llama_ckpt):
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        llm = LLM(str(llama_ckpt), dtype=dtype, num_kv_blocks=32)
        assert llm.engine.kv.data.dtype == torch_dtype
        assert next(llm.engine.model.parameters()).dtype == torch_dtype
        out = llm.generate(
            {"prompt_token_ids": [1000, 2000, 3000]}, SamplingParams(temperature=0, max_tokens=4)
        )
        assert len(out[0].outputs[0].token_ids) >= 1


def test_generation_config_supplies_default_sampling(llama_ckpt, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(llama_ckpt, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(gen))
    sp = LLM(str(path), num_kv_blocks=16).get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)


def test_prompt_forms_and_chat(llava_ckpt):
    llm = LLM(str(llava_ckpt), num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    text = llm.generate("hello world", greedy)[0]
    ids = llm.generate({"prompt_token_ids": text.prompt_token_ids}, greedy)[0]
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids
    assert text.prompt_token_ids[-1] != llm.tokenizer.eos_token_id  # no EOS appended to prompts
    image = random_image(4)
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}],
            }
        ],
        greedy,
    )[0]
    vllm_style = llm.generate(
        {"prompt": chat.prompt, "multi_modal_data": {"image": image}}, greedy
    )[0]
    assert chat.outputs[0].token_ids == vllm_style.outputs[0].token_ids
    assert (
        chat.prompt_token_ids.count(llm.engine.model.image_token_id)
        == llm.engine.model.tokens_per_image
    )


def test_dummy_load_format_builds_the_architecture_with_random_weights(llama_ckpt):
    real = LLM(str(llama_ckpt), num_kv_blocks=16)
    dummy = LLM(str(llama_ckpt), load_format="dummy", num_kv_blocks=16)
    w_real = real.engine.model.model.layers[0].mlp.down_proj.weight
    w_dummy = dummy.engine.model.model.layers[0].mlp.down_proj.weight
    assert w_real.shape == w_dummy.shape and not torch.equal(w_real, w_dummy)
    out = dummy.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3)
    )
    assert len(out[0].outputs[0].token_ids) >= 1
