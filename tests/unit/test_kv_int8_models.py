"""``kv_cache_dtype="int8"``: the engine against transformers whose attention reads every
key and value through the same quantization (int8 codes and a scale per token and KV
head, then dequantized): greedy tokens identical, logprobs close.

Prompts of several lengths in one batch, a token budget that chunks the prefills, and a
repeated prompt (prefix caching: the second round reads blocks the first wrote) all go
through the int8 cache; so does the native one-call decode step of the cpu backend.
"""

import pytest
import torch

from services.llm import LLM
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.reference import hf_greedy, load_hf, read_kv_as_int8

pytestmark = pytest.mark.slow

MAX_NEW = 10
PROMPTS = [[5 + (i * 37 + j * 11) % 900 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]


@pytest.mark.parametrize(
    "kind,backend", [("llama", "cpu"), ("llama", "torch"), ("nemotron_h", "cpu")]
)
def test_greedy_matches_transformers_reading_int8_kv(tmp_path_factory, kind, backend):
    ckpt = make_text_checkpoint(tmp_path_factory.getbasetemp() / "kv8", kind)
    hf = read_kv_as_int8(load_hf(ckpt))
    refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(
        str(ckpt),
        kv_cache_dtype="int8",
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
    )
    assert llm.engine.kv.data.dtype == torch.int8
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    for _ in range(2):  # the second time the llama prompts come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for out, (ids, top) in zip(outs, refs, strict=True):
            comp = out.outputs[0]
            assert comp.token_ids == ids
            for ours, theirs in zip(comp.logprobs, top, strict=False):
                for tid, lp in theirs:
                    assert abs(ours[tid].logprob - lp) < 2e-3


def test_int8_kv_holds_about_four_times_the_tokens(llama_ckpt):
    full = LLM(str(llama_ckpt), kv_cache_memory_mb=4)
    small = LLM(str(llama_ckpt), kv_cache_memory_mb=4, kv_cache_dtype="int8")
    d = full.engine.model.head_dim
    assert small.engine.kv.num_blocks == pytest.approx(
        full.engine.kv.num_blocks * 4 * d / (d + 4), rel=0.01
    )


def test_unknown_kv_cache_dtype_is_a_clear_error(llama_ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama_ckpt), kv_cache_dtype="int3")
