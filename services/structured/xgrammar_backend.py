"""xgrammar, the optional second grammar backend (``--structured-outputs-backend
xgrammar``, where the package is installed): it compiles JSON schemas, regexes, choices
and GBNF grammars; llguidance keeps what only it reads (Lark with its extensions: the
gateway's tool and reasoning grammars, structural tags). Both write the same bitmask (a
set bit allows a token, 32 tokens an int32 word), so one step's masks mix freely."""

from __future__ import annotations

import json
from typing import Any

import torch

from services.structured.outputs import StructuredOutputs
from services.structured.tokenizer import wordpiece_table


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def handles(constraint: StructuredOutputs) -> bool:
    """Whether xgrammar compiles this constraint (else llguidance does)."""
    if constraint.reasoning_end is not None or constraint.structural_tag is not None:
        return False
    grammar = constraint.grammar
    return grammar is None or ("::=" in grammar and not grammar.lstrip().startswith("%"))


class XGrammarCompiler:
    """One model's tokenizer as xgrammar sees it, and its compiler (xgrammar keeps its
    own cache of compiled grammars)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int):
        import xgrammar as xgr

        if type(tokenizer.backend_tokenizer.model).__name__ == "WordPiece":
            # xgrammar cannot read WordPiece either: the bytes each token adds, as
            # llguidance gets them (services/structured/tokenizer.py).
            table = wordpiece_table(tokenizer, eos_token_ids, vocab_size)
            info = xgr.TokenizerInfo(
                table, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos_token_ids
            )
        else:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
            )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.stop_ids = list(eos_token_ids)

    def compile(self, c: StructuredOutputs):
        """The compiled grammar; ValueError saying why not."""
        try:
            return self._compile(c)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {e}") from e

    def _compile(self, c: StructuredOutputs):
        if c.json is not None or c.json_object:
            schema = c.json if c.json is not None else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return self.compiler.compile_json_schema(text, any_whitespace=False)
        if c.regex is not None:
            return self.compiler.compile_regex(c.regex)
        if c.choice is not None:
            choices = " | ".join(json.dumps(x, ensure_ascii=False) for x in c.choice)
            return self.compiler.compile_grammar(f"root ::= {choices}")
        return self.compiler.compile_grammar(c.grammar)

    def matcher(self, compiled, produced: list[int], vocab: int) -> XGrammarMatcher:
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        for token in produced:
            if not m.accept_token(int(token)):
                raise ValueError("structured_outputs: earlier tokens break it")
        return XGrammarMatcher(m, vocab, self.stop_ids)


class XGrammarMatcher:
    """One request's position in its xgrammar grammar (the interface of
    services/structured/matcher.py Matcher)."""

    def __init__(self, matcher: Any, vocab: int, stop_ids: list[int]):
        self.m, self.vocab, self.stop_ids = matcher, vocab, stop_ids
        # A token it refused (xgrammar, unlike llguidance, stays where it was): from
        # then on only the end is allowed, as llguidance does.
        self.broken = False

    def accept(self, token: int) -> None:
        self.broken = self.broken or not self.m.accept_token(int(token))

    def fill(self, bits, row: int) -> None:
        """Write this matcher's mask into row ``row`` of a bitmask array."""
        if not self.broken:
            self.m.fill_next_token_bitmask(torch.from_numpy(bits), row)
            return
        bits[row] = 0
        for t in self.stop_ids:
            bits[row, t // 32] |= 1 << (t % 32)

    def try_token(self, token: int) -> bool:
        return not self.broken and self.m.accept_token(int(token))

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        taken = 0
        while taken < len(drafts) and self.try_token(drafts[taken]):
            taken += 1
        if taken:
            self.rollback(taken)
        return list(drafts[:taken])

    def forced(self) -> list[int]:
        return [] if self.broken else list(self.m.find_jump_forward_tokens())

    def masks_along(self, drafts: list[int]) -> torch.Tensor:
        from services.structured.matcher import masks_along

        return masks_along(self, drafts)
