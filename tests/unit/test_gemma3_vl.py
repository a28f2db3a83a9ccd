"""Gemma 3 with images against transformers on a tiny random checkpoint: the chat
template's <start_of_image> spelled out as the processor does, image tokens that see the
whole image (bidirectional inside it), sliding-window layers, several images, multi-turn
chat; prefill chunks that never end inside an image, and the prefix cache over one;
n-gram speculation and a JSON schema."""

from __future__ import annotations

import json

import pytest

from services import LLM, SamplingParams
from tests.helpers.checkpoints import make_gemma3_checkpoint, random_image
from tests.helpers.reference import check_greedy, gemma3_reference, load_hf
from tests.helpers.schemas import RECORD

pytestmark = pytest.mark.slow

MAX_NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), block_size=4, num_kv_blocks=512)


def _user(*parts):
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
            for p in parts
        ],
    }


def _reference(ckpt, hf, messages):
    return gemma3_reference(ckpt, hf, messages, MAX_NEW)


def _check(out, ref):
    ids, greedy = ref
    assert out.prompt_token_ids == ids
    check_greedy(out, greedy)


def _greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)


CASES = {
    "text": [_user("a question with no image and enough words to pass the window")],
    "one-image": [_user(random_image(1, (60, 90)), "what is in the picture")],
    "two-images": [_user("compare", random_image(2, (120, 50)), "with", random_image(3, (33, 33)))],
    "multi-turn": [
        _user(random_image(4, (40, 40)), "first look"),
        {"role": "assistant", "content": "a small square of noise"},
        _user("and now this one", random_image(5, (90, 60))),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_chat_matches_transformers(ckpt, hf, llm, case):
    messages = CASES[case]
    _check(llm.chat(messages, _greedy())[0], _reference(ckpt, hf, messages))


def test_the_image_attention_is_bidirectional(ckpt, hf, llm):
    """With causal attention inside the image the answer differs: the test above can fail."""
    messages = CASES["one-image"]
    ids, (tokens, _) = _reference(ckpt, hf, messages)
    causal = LLM(str(ckpt), block_size=4, num_kv_blocks=512)
    causal.engine.runner.images.bidirectional = False
    assert causal.chat(messages, _greedy())[0].outputs[0].token_ids != tokens


def test_prefill_chunks_keep_each_image_whole_and_share_it(ckpt, hf):
    """A 6-token step budget would split the 4-token image; chunks end before it
    instead. A second chat with the same image and opening reuses its cached blocks."""
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=512, max_num_batched_tokens=6, max_num_seqs=2)
    img = random_image(20, (50, 70))
    for messages in ([_user(img, "describe it")], [_user(img, "describe it in other words")]):
        out = llm.chat(messages, _greedy())[0]
        _check(out, _reference(ckpt, hf, messages))
    assert out.num_cached_tokens >= 4
    with pytest.raises(ValueError, match="in one chunk"):
        LLM(str(ckpt), block_size=4, num_kv_blocks=64, max_num_batched_tokens=4, max_num_seqs=2)


def test_speculation_and_a_json_schema_change_no_token(ckpt, llm):
    """n-gram drafts verified through the sliding-window layers (several rows a step)
    give the tokens plain decoding gives, with and without a JSON schema."""
    messages = [_user(random_image(40, (60, 60)), "describe the picture in words")]
    asks = [None, {"json": RECORD}]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=a) for a in asks]
    plain = [llm.chat(messages, p)[0].outputs[0] for p in params]
    assert set(json.loads(plain[1].text)) == {"name", "n", "color"}
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    spec = LLM(str(ckpt), block_size=4, num_kv_blocks=512, speculative_config=cfg)
    for p, want in zip(params, plain, strict=True):
        assert spec.chat(messages, p)[0].outputs[0].token_ids == want.token_ids
    assert spec.engine.spec.stats.accepted_tokens > 0
