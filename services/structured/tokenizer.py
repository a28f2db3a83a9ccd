"""The model's tokenizer as llguidance sees it (an ``LLTokenizer``): the bytes each token
adds to the text, and a tokenize function consistent with them.

Byte-level BPE (Qwen, Llama 3) and SentencePiece (Llama 2, Mistral) are read by
llguidance itself. WordPiece (the demo model) it cannot read, so its table is built
here from what the WordPiece decoder writes: a ``##`` piece adds its text, any other
token a space and its text (then the decoder's per-token clean-up: no space before
``.``, ``,``, ``?``, ``!``). Special tokens get a ``\\xff`` prefix, which marks them
special for llguidance, so no text grammar can choose them.
"""

from __future__ import annotations

from typing import Any

from services.tokenizer_json import CLEANUPS

# What tokenizers' WordPiece decoder (cleanup on) rewrites in each token's text:
# transformers' clean-up, and one rewrite of its own.
_CLEANUP = (*CLEANUPS, (" do not", " don't"))
_SPECIAL = b"\xff"


def guidance_tokenizer(tokenizer: Any, eos_token_ids: list[int], vocab_size: int):
    """An ``llguidance.LLTokenizer`` for ``tokenizer`` (transformers' fast tokenizer):
    ``eos_token_ids`` are the tokens that end a finished grammar; ``vocab_size`` the
    width of the model's logits (it may exceed the tokenizer's)."""
    import llguidance
    import llguidance.hf

    model = tokenizer.backend_tokenizer.model
    if type(model).__name__ != "WordPiece":
        return llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
    table = _WordPieceTable(tokenizer, eos_token_ids, vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table))


def wordpiece_table(tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> list[bytes]:
    """The bytes each WordPiece token adds to the text (special ones marked), for a
    grammar backend that cannot read WordPiece (xgrammar too)."""
    return _WordPieceTable(tokenizer, eos_token_ids, vocab_size).tokens


class _WordPieceTable:
    """What ``llguidance.TokenizerWrapper`` reads: ``tokens`` (the bytes of each id),
    the special ids, and ``__call__`` (text -> ids)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int):
        decoder = tokenizer.backend_tokenizer.decoder
        prefix = getattr(decoder, "prefix", "##")
        cleanup = getattr(decoder, "cleanup", True)
        special = set(tokenizer.all_special_ids) | set(eos_token_ids)
        names = {i: t for t, i in tokenizer.get_vocab().items()}
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            name = names.get(i)
            if name is None or i in special or (name.startswith("[") and name.endswith("]")):
                self.tokens.append(_SPECIAL + (name or f"<{i}>").encode())
            elif name.startswith(prefix):
                self.tokens.append(name[len(prefix) :].encode())
            else:
                text = " " + name
                for old, new in _CLEANUP if cleanup else ():
                    text = text.replace(old, new)
                self.tokens.append(text.encode())
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.sep_token_id
        self.bos_token_id = tokenizer.cls_token_id
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b and not b.startswith(_SPECIAL):
                self._ids.setdefault(b, i)
        self._longest = max(len(b) for b in self._ids)

    def __call__(self, text: str | bytes) -> list[int]:
        """Greedy longest match over ``tokens``. llguidance tokenizes the bytes a grammar
        forces with this and allows the first id, so it must agree with the table (the
        real tokenizer would read a forced ``{`` as `` {``); it stops at a byte no token
        holds rather than skip it, which would let the mask allow a wrong token."""
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                break
        return out
