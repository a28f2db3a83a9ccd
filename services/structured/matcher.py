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
from services.structured.xgrammar_backend import XGrammarCompiler, handles, xgrammar_available


class GrammarSet:
    """Compiles constraints for one model's tokenizer (built on first use: ~0.1 s for
    30 k tokens, ~1 s for 150 k) and makes each request's matcher.

    Compiled grammars are kept (the last ``cache_size``, by the constraint's key): a
    request repeating a schema, as agents and pipelines do, copies a compiled matcher
    instead of compiling again, and the engine's check before admission and the matcher
    after it cost one compile between them."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: list[int],
        vocab_size: int,
        backend: str = "auto",
        cache_size: int = 256,
    ):
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._ll = None
        # xgrammar compiles what it can (services/structured/xgrammar_backend.py).
        self._xgr = None
        if backend == "xgrammar":
            if not xgrammar_available():
                raise ValueError(
                    "structured outputs backend xgrammar: the package is not installed"
                )
            self._xgr = XGrammarCompiler(tokenizer, self.eos_token_ids, vocab_size)
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

    def matcher(self, constraint: StructuredOutputs, produced: list[int]):
        """A request's matcher, advanced over the tokens it has already produced (a
        resumed or migrated request)."""
        if self._xgr is not None and handles(constraint):
            return self._xgr.matcher(self._compiled_matcher(constraint), produced, self.vocab_size)
        m = self._compiled_matcher(constraint).deep_copy()
        if produced and not m.consume_tokens(list(produced)):
            raise ValueError(f"structured_outputs: earlier tokens break it: {m.get_error()}")
        return Matcher(m, self.vocab_size)

    def _compiled_matcher(self, constraint: StructuredOutputs):
        """The constraint compiled once: llguidance's pristine matcher (never advanced
        itself), or xgrammar's compiled grammar."""
        key = constraint.key()
        with self._lock:
            if (m := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return m
        if self._xgr is not None and handles(constraint):
            m = self._xgr.compile(constraint)
        else:
            m = self._guidance(constraint)
        with self._lock:
            self._compiled[key] = m
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return m

    def _guidance(self, constraint: StructuredOutputs):
        from llguidance import LLMatcher

        try:
            m = LLMatcher(self.ll, constraint.lark(), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"structured_outputs: {e}") from e
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab: int):
        self.m, self.vocab = matcher, vocab  # vocab: the width of the model's logits

    def accept(self, token: int) -> None:
        """Advance over a sampled token (drawn under this matcher's mask). A token the
        grammar refuses puts it in error: from then on only EOS is allowed."""
        self.m.consume_token(int(token))

    def fill(self, bits, row: int) -> None:
        """Write this matcher's mask into row ``row`` of a bitmask array."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, bits, row)

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar allows (nothing consumed)."""
        return list(drafts[: self.m.validate_tokens(list(drafts))])

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would draw."""
        return list(self.m.compute_ff_tokens())

    def masks_along(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab] bool: the tokens forbidden before each draft and after
        the last (a verification's rows); the matcher is rolled back to where it was."""
        return masks_along(self, drafts)

    def try_token(self, token: int) -> bool:
        return self.m.consume_token(int(token))

    def rollback(self, n: int) -> None:
        self.m.rollback(n)


def masks_along(matcher, drafts: list[int]) -> torch.Tensor:
    """``Matcher.masks_along`` for either backend's matcher (``fill``, ``try_token``,
    ``rollback``)."""
    bits = bitmask(len(drafts) + 1, matcher.vocab)
    taken = 0
    for row in range(len(drafts) + 1):
        matcher.fill(bits, row)
        if row < len(drafts) and matcher.try_token(drafts[row]):
            taken += 1
    if taken:
        matcher.rollback(taken)
    return forbidden_of(bits, matcher.vocab)


_SHIFTS = torch.arange(32, dtype=torch.int32)
_llg_executor = None
# One thread computes a step's masks while the forward runs on the caller's: llguidance
# releases the GIL, so on a CPU the masks take a core the forward's torch thread leaves.
_mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-masks")


def forbidden_tokens(matchers: list) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each grammar forbids next. llguidance's
    masks are computed at once, on its own threads; xgrammar's one by one."""
    global _llg_executor
    from llguidance import LLExecutor
    from llguidance.numpy import fill_next_token_bitmask_par

    if _llg_executor is None:
        _llg_executor = LLExecutor()
    vocab = matchers[0].vocab
    bits = bitmask(len(matchers), vocab)
    guided = [(m.m, i) for i, m in enumerate(matchers) if isinstance(m, Matcher)]
    if guided:
        fill_next_token_bitmask_par(_llg_executor, guided, bits)
    for i, m in enumerate(matchers):
        if not isinstance(m, Matcher):
            m.fill(bits, i)
    return forbidden_of(bits, vocab)


def bitmask(rows: int, vocab: int):
    """A bitmask array of ``rows`` masks (int32 words, a set bit allows a token)."""
    from llguidance.numpy import allocate_token_bitmask

    return allocate_token_bitmask(rows, vocab)


def forbidden_of(bits, vocab: int) -> torch.Tensor:
    """A bitmask array's rows as [rows, vocab] bool: True where a token is forbidden."""
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
