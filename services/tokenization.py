"""Tokenizer loading and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from services.models.checkpoint import CheckpointError
from services.tokenizer_json import JsonTokenizer, has_tokenizer_json


def load_tokenizer(model_dir: str | Path, torch_free: bool = False):
    """transformers' AutoTokenizer; ``torch_free`` (the gateway): the checkpoint's
    tokenizer.json through ``JsonTokenizer`` when there is one (transformers' tokenizer
    classes import torch)."""
    if torch_free and has_tokenizer_json(model_dir):
        return JsonTokenizer(model_dir)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer from {model_dir}: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (from ``prefix_offset``) and emits only the part after the
    previously emitted text; a window whose text ends in U+FFFD is an incomplete
    multi-byte character and is held back until the next token completes it.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # Start the window a few prompt tokens back so the first word gets its spacing.
        self.tokens = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the new text (possibly empty)."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :] if full.startswith(prefix) else full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output: the text still held back (an unfinished character
        decodes as U+FFFD), so a cut in mid-character does not lose the text before it."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.text += delta
        return delta
