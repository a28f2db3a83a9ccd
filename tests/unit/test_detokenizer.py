"""Incremental detokenization never emits half a character and adds up to the full text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from services.tokenization import IncrementalDetokenizer

TEXT = "naïve café — 東京 🚀🎉 ok, ünïcödé everywhere. "


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A byte-level BPE trained offline on a few lines: multi-byte characters split over
    several tokens, as with GPT-2 / Llama-3 style tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["plain ascii words only, the quick brown fox"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_deltas_never_split_a_character_and_sum_to_the_text(byte_level_tokenizer):
    tok = byte_level_tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # characters really are split over several tokens
    detok = IncrementalDetokenizer(tok, prompt_ids=[], skip_special_tokens=True)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to be held back


def test_prompt_context_gives_the_first_word_its_space(byte_level_tokenizer):
    tok = byte_level_tokenizer
    prompt = tok.encode("the quick")
    gen = tok.encode(" brown fox")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.add([t]) for t in gen) == " brown fox"


def test_an_output_cut_in_mid_character_keeps_its_text(byte_level_tokenizer):
    """All ids at once (the offline final-only path) ending half-way through a
    character: the text before it is kept and the cut shows as U+FFFD."""
    tok = byte_level_tokenizer
    ids = tok.encode("ok 東京")[:-1]  # the last character's final byte is missing
    detok = IncrementalDetokenizer(tok, prompt_ids=[])
    assert detok.add(ids) == ""  # held back: it ends in an unfinished character
    text = detok.flush()
    assert text.startswith("ok 東") and text.endswith("\ufffd") and detok.text == text
    assert detok.flush() == ""
