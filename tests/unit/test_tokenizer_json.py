"""The gateway's torch-free tokenizer (tokenizer.json + jinja2) against transformers'
AutoTokenizer on the same files: identical ids, text and rendered chat templates, for a
WordPiece (the demo's), a byte-level BPE and a Metaspace (SentencePiece-style) BPE
tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.models.demo import CHAT_TEMPLATE, _build_tokenizer
from services.tokenizer_json import JsonTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14 degrees, isn't it?",
    "Déjà vu: naïve café owners say \u4f60\u597d and \u3053\u3093\u306b\u3061\u306f \U0001f600!",
    "def f(x):\n    return x ** 2  # squares\n\ttabs and   spaces",
] * 20

TEXTS = [
    "hello world",
    "  leading spaces",
    "Don't stop, won't stop !",
    "\u4f60\u597d\uff0c\u4e16\u754c",
    "emoji \U0001f680\U0001f680 end",
    "line\nbreak\n\nand more",
    "",
    "x" * 300,
    "[CLS] literal [SEP]",
]

QWEN_LIKE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{%- endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{{ '' if not messages else '' }}{% set x = messages | length %}{{ bos_token }}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}],
]


def _bpe(tmp_path, byte_level: bool):
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        specials.append("<unk>")
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    if not byte_level:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    out = tmp_path / ("bytelevel" if byte_level else "metaspace")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<s>",
        unk_token=None if byte_level else "<unk>",
    )
    fast.chat_template = QWEN_LIKE
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=["wordpiece", "bytelevel", "metaspace"])
def pair(request, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "wordpiece":
        _build_tokenizer(root)
    else:
        root = _bpe(root, request.param == "bytelevel")
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True), JsonTokenizer(root)


def test_encode_is_identical(pair):
    hf, ours = pair
    for text in TEXTS + CORPUS[:3]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            ), text


def test_decode_is_identical(pair):
    hf, ours = pair
    rng = random.Random(0)
    samples = [hf.encode(t) for t in TEXTS] + [
        [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))] for _ in range(200)
    ]
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), ids
    assert ours.eos_token_id == hf.eos_token_id and len(ours) == len(hf)


def test_chat_templates_render_identically(pair):
    hf, ours = pair
    assert ours.chat_template == hf.chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            assert ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == (
                hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            )


def test_demo_template_is_the_one_checked():
    assert "message['content'] is string" in CHAT_TEMPLATE
