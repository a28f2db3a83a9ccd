"""``kv_cache_dtype="int8" | "fp8"``: the engine against transformers whose attention
reads every key and value through the same quantization (codes and a scale per token and
KV head, then dequantized): greedy tokens identical, logprobs close.

Prompts of several lengths in one batch, a token budget that chunks the prefills, and a
repeated prompt (prefix caching: the second round reads blocks the first wrote) all go
through the quantized cache; so does the native one-call decode step of the cpu backend.
"""

import pytest
import torch

from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.reference import check_greedy, hf_greedy, load_hf, read_kv_quantized

pytestmark = pytest.mark.slow

MAX_NEW = 10
PROMPTS = [[5 + (i * 37 + j * 11) % 900 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]


@pytest.mark.parametrize(
    "kind,backend,fmt",
    [
        ("llama", "cpu", "int8"),
        ("llama", "torch", "int8"),
        ("nemotron_h", "cpu", "int8"),
        ("llama", "cpu", "fp8"),
        ("llama", "torch", "fp8"),
    ],
)
def test_greedy_matches_transformers_reading_quantized_kv(tmp_path_factory, kind, backend, fmt):
    ckpt = make_text_checkpoint(tmp_path_factory.getbasetemp() / "kv8", kind)
    hf = read_kv_quantized(load_hf(ckpt), fmt)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(
        str(ckpt),
        kv_cache_dtype=fmt,
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
    )
    assert llm.engine.kv.data.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    for _ in range(2):  # the second time the llama prompts come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for out, ref in zip(outs, refs, strict=True):
            check_greedy(out, ref, tol=2e-3)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_kv_cache_holds_about_four_times_the_tokens(llama_ckpt, fmt):
    full = LLM(str(llama_ckpt), kv_cache_memory_mb=4)
    small = LLM(str(llama_ckpt), kv_cache_memory_mb=4, kv_cache_dtype=fmt)
    d = full.engine.model.head_dim
    assert small.engine.kv.num_blocks == pytest.approx(
        full.engine.kv.num_blocks * 4 * d / (d + 4), rel=0.01
    )


def test_unknown_kv_cache_dtype_is_a_clear_error(llama_ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama_ckpt), kv_cache_dtype="int3")


@pytest.mark.parametrize("fmt,weights", [("int8", None), ("fp8", "int4")])
def test_speculation_over_a_quantized_cache_changes_no_token(llama_ckpt, fmt, weights):
    """n-gram drafts verified as rows of one step read and write the quantized cache as
    plain decoding does: the same tokens (a repetitive prompt, so drafts are accepted)."""
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = {"kv_cache_dtype": fmt, "quantization": weights, "block_size": 4}
    plain = LLM(str(llama_ckpt), num_kv_blocks=256, **common).generate(prompt, params)
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec = LLM(str(llama_ckpt), num_kv_blocks=256, speculative_config=cfg, **common)
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec.engine.spec.stats.accepted_tokens > 0
