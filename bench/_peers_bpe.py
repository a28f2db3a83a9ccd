"""The shared peers Llama with a byte-level BPE tokenizer, for constrained generation.

Structured-output backends (llguidance, xgrammar) must know the bytes of every token. The
WordLevel vocabulary of ``_peers_checkpoint.text_checkpoint`` (``w123`` words) and the
demo's WordPiece are not something every backend reads; byte-level BPE (GPT-2, Llama 3,
Qwen) is read by all of them. This builds one offline: 32,000 pieces (``<unk> <s> </s>``
first, as in the shared vocabulary, so BOS is 1 and EOS is 2) trained on the Python
standard library's sources, which are on every machine. The weights and config are the
shared checkpoint's own, linked, not copied: same vocabulary size, same model.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import _peers_checkpoint as ckpt

NAME = f"{ckpt.TEXT_NAME}-bpe"
CORPUS_BYTES = 24 << 20  # enough text for 32,000 pieces; trains in ~10 s


def _stdlib_sources(limit: int = CORPUS_BYTES) -> Iterator[str]:
    """The standard library's ``.py`` files in name order (not site-packages), ``limit``
    bytes in all: the same corpus, so the same tokenizer, on every machine of a version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or seen >= limit:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        seen += len(text)
        yield text


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=ckpt.VOCAB,
        special_tokens=list(ckpt.SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_stdlib_sources(), trainer=trainer)
    if backend.get_vocab_size() != ckpt.VOCAB:
        raise RuntimeError(f"BPE trained {backend.get_vocab_size()} pieces, not {ckpt.VOCAB}")
    ckpt.save_fast_tokenizer(backend, out)


def bpe_checkpoint(cache: Path) -> Path:
    """``text_checkpoint``'s weights (linked) with a byte-level BPE tokenizer, built once."""
    return ckpt.with_tokenizer(cache, NAME, _save_tokenizer)


if __name__ == "__main__":
    print(bpe_checkpoint(Path.home() / ".cache" / "epd-serve" / "peers"))
