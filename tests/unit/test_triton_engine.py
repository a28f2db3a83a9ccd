"""A tiny model generates the same greedy tokens with the Triton backend as with torch.

On CPU the Triton kernels run in the interpreter. A small token budget forces chunked
prefill and mixed prefill/decode steps; shared prompt prefixes hit the prefix cache, so
the extend kernel sees cached prefixes and the decode kernel sees many block sizes.
"""

import pytest

from services import LLM, SamplingParams

pytestmark = [pytest.mark.triton, pytest.mark.slow]

PREFIX = [1000 + 3 * j for j in range(9)]
PROMPTS = [PREFIX + [2000 + j for j in range(n)] for n in (1, 6, 24)] + [
    [1500, 1501],
    [1200 + j for j in range(17)],
]


def _greedy_tokens(ckpt, backend: str) -> list[list[int]]:
    llm = LLM(
        model=str(ckpt),
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=20,  # chunked prefill, prefill and decode in one step
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_generates_the_torch_greedy_tokens(tmp_path, arch: str) -> None:
    from tests.helpers.checkpoints import make_text_checkpoint

    ckpt = make_text_checkpoint(tmp_path, arch)
    want = _greedy_tokens(ckpt, "torch")
    got = _greedy_tokens(ckpt, "triton")
    assert all(len(t) == 8 for t in want)
    assert got == want
