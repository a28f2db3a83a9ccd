"""Grammars in the sampler: a model's tokenizer for llguidance and each request's matcher
(``GrammarSet``), and a step's masks (``start_masks``, ``apply_masks``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from services.structured.outputs import StructuredOutputs
from services.structured.tokenizer import guidance_tokenizer


class GrammarSet:
    """Compiles constraints for one model's tokenizer (built on first use: ~0.1 s for
    30 k tokens, ~1 s for 150 k) and makes each request's matcher.

    Compiled grammars are kept (the last ``cache_size``, by the constraint's key): a
    request repeating a schema, as agents and pipelines do, copies a compiled matcher
    instead of compiling again, and the engine's check before admission and the matcher
    after it cost one compile between them."""

    def __init__(
        self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int, cache_size: int = 256
    ):
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._ll = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # serve all's gateway checks from a worker thread

    @property
    def ll(self):
        """The ``LLTokenizer`` (two threads asking first may both build it: harmless)."""
        if self._ll is None:
            self._ll = guidance_tokenizer(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._ll

    def check(self, constraint: StructuredOutputs) -> None:
        """ValueError saying why the constraint does not compile (else it is kept)."""
        self._compiled_matcher(constraint)

    def matcher(self, constraint: StructuredOutputs, produced: list[int]) -> Matcher:
        """A request's matcher, advanced over the tokens it has already produced (a
        resumed or migrated request)."""
        m = self._compiled_matcher(constraint).deep_copy()
        if produced and not m.consume_tokens(list(produced)):
            raise ValueError(f"structured_outputs: earlier tokens break it: {m.get_error()}")
        return Matcher(m, self.vocab_size)

    def _compiled_matcher(self, constraint: StructuredOutputs):
        """The constraint's pristine matcher, compiled once (never advanced itself)."""
        from llguidance import LLMatcher

        key = constraint.key()
        with self._lock:
            if (m := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return m
        try:
            m = LLMatcher(self.ll, constraint.lark(), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"structured_outputs: {e}") from e
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        with self._lock:
            self._compiled[key] = m
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return m


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab: int):
        self.m, self.vocab = matcher, vocab  # vocab: the width of the model's logits

    def accept(self, token: int) -> None:
        """Advance over a sampled token (drawn under this matcher's mask). A token the
        grammar refuses puts it in error: from then on only EOS is allowed."""
        self.m.consume_token(int(token))

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar allows (nothing consumed)."""
        return list(drafts[: self.m.validate_tokens(list(drafts))])

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would draw."""
        return list(self.m.compute_ff_tokens())

    def masks_along(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab] bool: the tokens forbidden before each draft and after
        the last (a verification's rows); the matcher is rolled back to where it was."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bits = allocate_token_bitmask(len(drafts) + 1, self.vocab)
        taken = 0
        for row in range(len(drafts) + 1):
            fill_next_token_bitmask(self.m, bits, row)
            if row < len(drafts) and self.m.consume_token(int(drafts[row])):
                taken += 1
        if taken:
            self.m.rollback(taken)
        return _forbidden(bits, self.vocab)


_SHIFTS = torch.arange(32, dtype=torch.int32)
_llg_executor = None
# One thread computes a step's masks while the forward runs on the caller's: llguidance
# releases the GIL, so on a CPU the masks take a core the forward's torch thread leaves.
_mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-masks")


def forbidden_tokens(matchers: list[Matcher]) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each grammar forbids next (the masks
    computed at once, on llguidance's own threads)."""
    global _llg_executor
    from llguidance import LLExecutor
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    if _llg_executor is None:
        _llg_executor = LLExecutor()
    vocab = matchers[0].vocab
    bits = allocate_token_bitmask(len(matchers), vocab)
    fill_next_token_bitmask_par(_llg_executor, [(m.m, i) for i, m in enumerate(matchers)], bits)
    return _forbidden(bits, vocab)


def _forbidden(bits, vocab: int) -> torch.Tensor:
    """llguidance's bitmask rows (a set bit allows a token) as [rows, vocab] forbidden."""
    bit = (torch.from_numpy(np.ascontiguousarray(bits)).unsqueeze(-1) >> _SHIFTS) & 1
    return bit.view(bits.shape[0], -1)[:, :vocab] == 0


def start_masks(matchers: list[Matcher]) -> Future:
    """``forbidden_tokens`` on the mask thread: start it before the forward, take its
    result after."""
    return _mask_thread.submit(forbidden_tokens, matchers)


def apply_masks(logits: torch.Tensor, rows: list[int], forbidden: torch.Tensor) -> None:
    """Set the logits of ``rows`` that ``forbidden`` names to -inf, in place."""
    forbidden = forbidden.to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: no gather, no scatter
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
