"""Qwen2.5-VL and Qwen3-VL against transformers on tiny random checkpoints: images of several sizes
(so several token counts), several images in one prompt, multi-turn chat, chunked
prefill through an image, the prefix cache over a shared image, processor options, and
the multimodal rotary positions themselves; speculative decoding and a JSON schema
over an image prompt."""

from __future__ import annotations

import json

import pytest
import torch

from services import LLM, SamplingParams
from services.engine.request import ImageSpan
from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.decoding import SpecDecoding
from services.models.mrope import rope_positions
from tests.helpers.checkpoints import (
    make_qwen2_5_vl_checkpoint,
    make_qwen3_vl_checkpoint,
    random_image,
)
from tests.helpers.reference import check_greedy, hf_greedy, load_hf
from tests.helpers.schemas import RECORD
from tests.helpers.spec_proposers import OracleProposer

pytestmark = pytest.mark.slow

MAX_NEW = 12
SIZES = [(60, 90), (120, 50), (33, 33), (200, 140)]


MAKE = {"qwen2_5_vl": make_qwen2_5_vl_checkpoint, "qwen3_vl": make_qwen3_vl_checkpoint}


@pytest.fixture(scope="module", params=list(MAKE))
def ckpt(request, tmp_path_factory):
    return MAKE[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), block_size=4, num_kv_blocks=512)


def _reference(ckpt, hf, text: str, images, max_pixels: int | None = None):
    """(expanded prompt ids, transformers' greedy ids and top-5) for a rendered prompt."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    pad = hf.config.image_token_id
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, hf_greedy(hf, ids, MAX_NEW)
    proc = AutoImageProcessor.from_pretrained(str(ckpt), backend="pil")
    kw = {}
    if max_pixels:
        kw["size"] = {"shortest_edge": proc.size.shortest_edge, "longest_edge": max_pixels}
    inputs = proc(images=images, return_tensors="pt", **kw)
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    expanded = [t for x in ids for t in ([x] * next(counts) if x == pad else [x])]
    mm_types = (torch.tensor([expanded]) == pad).int()
    ref = hf_greedy(
        hf,
        expanded,
        MAX_NEW,
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=mm_types,
    )
    return expanded, ref


def _render(ckpt, messages):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    plain = [
        {
            **m,
            "content": [
                {"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                for p in m["content"]
            ],
        }
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    return tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def _user(*parts):
    content = []
    for p in parts:
        content.append(
            {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
        )
    return {"role": "user", "content": content}


def _greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)


@pytest.mark.parametrize(
    "messages",
    [
        [_user("a question with no image")],
        [_user(random_image(1, SIZES[0]), "what is in the picture")],
        [_user("compare", random_image(2, SIZES[1]), "with", random_image(3, SIZES[3]))],
        [
            _user(random_image(4, SIZES[2]), "first look"),
            {"role": "assistant", "content": "a small square"},
            _user("and now this one", random_image(5, SIZES[0])),
        ],
    ],
    ids=["text", "one-image", "two-sizes", "multi-turn"],
)
def test_chat_matches_transformers(ckpt, hf, llm, messages):
    images = [
        p["image"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]
    expanded, ref = _reference(ckpt, hf, _render(ckpt, messages), images)
    out = llm.chat(messages, _greedy())
    assert out[0].prompt_token_ids == expanded
    check_greedy(out[0], ref)


def test_image_token_counts_follow_the_image(ckpt, llm):
    counts = []
    for i, size in enumerate(SIZES):
        out = llm.chat([_user(random_image(10 + i, size), "x")], SamplingParams(max_tokens=1))
        counts.append(out[0].prompt_token_ids.count(llm.engine.inputs.image_token_id))
    assert len(set(counts)) == len(SIZES), counts


def test_chunked_prefill_splits_an_image_and_the_prefix_cache_shares_it(ckpt, hf):
    img = random_image(20, SIZES[3])
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=512, max_num_batched_tokens=5)
    first = [_user(img, "describe it")]
    second = [_user(img, "describe it in other words")]
    for messages in (first, second):
        expanded, ref = _reference(ckpt, hf, _render(ckpt, messages), [img])
        out = llm.chat(messages, _greedy())
        assert out[0].prompt_token_ids == expanded
        check_greedy(out[0], ref)
    assert out[0].num_cached_tokens >= 20  # the image's blocks came from the cache


def test_max_pixels_changes_the_tokens_and_the_hash(ckpt, hf, llm):
    img = random_image(30, (200, 140))
    messages = [_user(img, "look")]
    small = 28 * 28 * 6
    expanded, ref = _reference(ckpt, hf, _render(ckpt, messages), [img], max_pixels=small)
    ids = llm.engine.tokenizer.encode(_render(ckpt, messages), add_special_tokens=False)
    prompt = {
        "prompt_token_ids": ids,
        "multi_modal_data": {"image": img},
        "mm_processor_kwargs": {"max_pixels": small},
    }
    out = llm.generate(prompt, _greedy())
    assert out[0].prompt_token_ids == expanded
    check_greedy(out[0], ref)
    default = llm.engine.inputs.process({**prompt, "mm_processor_kwargs": None}, False)
    sized = llm.engine.inputs.process(prompt, False)
    assert default.spans[0].length > sized.spans[0].length
    assert default.spans[0].image_hash != sized.spans[0].image_hash
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.engine.inputs.process({**prompt, "mm_processor_kwargs": {"max_pixels": -1}}, False)
    with pytest.raises(ValueError, match="unsupported keys"):
        llm.engine.inputs.process({**prompt, "mm_processor_kwargs": {"crop": 1}}, False)


def test_rope_positions_are_transformers(hf):
    pad = hf.config.image_token_id
    spans = [ImageSpan(3, 6, "a", (1, 3, 2)), ImageSpan(11, 8, "b", (1, 2, 4))]
    ids = [7] * 25
    for s in spans:
        ids[s.offset : s.offset + s.length] = [pad] * s.length
    t = torch.tensor([ids])
    grid = torch.tensor([[1, 6, 4], [1, 4, 8]])  # vision grids: merged, (1, 3, 2), (1, 2, 4)
    ref, delta = hf.model.get_rope_index(t, (t == pad).int(), image_grid_thw=grid)
    for start, n in ((0, 25), (5, 9), (19, 6)):
        ours = rope_positions(spans, start, n)
        assert ours == ref[:, 0, start : start + n].tolist()
    after = rope_positions(spans, 30, 1)
    assert after == [[30 + int(delta)]] * 3


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _spec_llm(ckpt, proposer=None) -> LLM:
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=512, speculative_config=NGRAM)
    if proposer is not None:
        eng = llm.engine
        eng.spec = SpecDecoding.build(
            SpeculativeConfig.parse(NGRAM), eng.loaded, eng.runner, proposer
        )
    return llm


def test_speculation_and_a_json_schema_over_images_change_no_token(ckpt, llm):
    """Verification rows after an image sit at M-RoPE positions shifted past it: an
    oracle's drafts (all accepted, so every step verifies several rows) and n-gram's
    give the very tokens plain decoding gives, with and without a JSON schema."""
    messages = [_user(random_image(40, SIZES[1]), "describe", random_image(41, SIZES[2]))]
    asks = [None, {"json": RECORD}]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=a) for a in asks]
    plain = [llm.chat(messages, p)[0] for p in params]
    assert set(json.loads(plain[1].outputs[0].text)) == {"name", "n", "color"}
    refs = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    vocab = llm.engine.loaded.text_config.vocab_size
    for spec in (_spec_llm(ckpt), _spec_llm(ckpt, OracleProposer(refs, vocab))):
        for p, want in zip(params, plain, strict=True):
            assert spec.chat(messages, p)[0].outputs[0].token_ids == want.outputs[0].token_ids
        assert spec.engine.spec.stats.accepted_tokens > 0


def test_spans_and_embeddings_from_another_service_are_checked(llm):
    """What prefill and decode receive over the bus (spans, embeddings) is refused
    unless it is what this model makes of the prompt."""
    inputs = llm.engine.inputs
    pad = inputs.image_token_id
    ids = [7, 8, pad, pad, pad, pad, pad, pad, 9]
    good = [ImageSpan(2, 6, "h", (1, 2, 3))]
    assert inputs.check_spans(ids, good) == good
    bad = {
        "overlap": [ImageSpan(2, 3, "h", (1, 1, 3)), ImageSpan(4, 3, "h", (1, 1, 3))],
        "not placeholders": [ImageSpan(1, 6, "h", (1, 2, 3))],
        "two frames": [ImageSpan(2, 6, "h", (2, 1, 3))],
        "grid product": [ImageSpan(2, 6, "h", (1, 2, 2))],
        "uncovered": [ImageSpan(2, 4, "h", (1, 2, 2))],
    }
    for name, spans in bad.items():
        with pytest.raises(ValueError):
            inputs.check_spans(ids, spans)
            pytest.fail(name)
    width = llm.engine.loaded.image_embedding_width
    prompt = {"prompt_token_ids": ids, "image_spans": good}
    for embeds in ([], [torch.zeros(5, width)], [torch.zeros(6, width + 1)]):
        with pytest.raises(ValueError, match="embedding"):
            llm.engine.add_request("bad", prompt, SamplingParams(max_tokens=1), image_embeds=embeds)


def test_a_preempted_image_import_fails_instead_of_recomputing(ckpt):
    """A decode instance holds an imported request's KV but not its images: preempted,
    the request ends with an error (the fleet's gateway retries it) rather than being
    recomputed with placeholder embeddings; the other request goes on."""
    from services.engine.llm_engine import _NO_EMBEDDINGS

    prefill = LLM(str(ckpt), block_size=4, num_kv_blocks=512).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = {"prompt_token_ids": [7] * 8}  # two full blocks: its next token needs a third
    image = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>what",
        "images": [random_image(50, SIZES[0])],
    }
    imports = []
    for rid, prompt in (("text", text), ("image", image)):
        p = prefill.inputs.process(prompt)
        prefill.add_request(rid, prompt, params, export_kv=True)
        for out in sum(iter(prefill.step, []), []):
            if out.request_id == rid and out.kv_blocks is not None:
                first, kv = out.outputs[0].token_ids_delta[0], out.kv_blocks
        imports.append((rid, p.token_ids, first, kv, p.spans))
    # One block to spare: both are admitted, then the image one outgrows its last block.
    blocks = sum(-(-len(ids) // 4) for _, ids, *_ in imports) + 1
    decode = LLM(str(ckpt), block_size=4, num_kv_blocks=blocks).engine
    for rid, ids, first, kv, spans in imports:
        decode.import_request(rid, ids, len(ids), first, params, kv, images=spans)
    outs = {o.request_id: o for o in sum(iter(decode.step, []), [])}
    assert outs["image"].error == _NO_EMBEDDINGS
    assert outs["text"].finished and outs["text"].error is None
