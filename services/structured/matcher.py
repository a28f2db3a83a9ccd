"""Grammars in the sampler: the compiled tokenizer of a model, one matcher per request,
and the step's masks (``GrammarSet``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.structured.outputs import StructuredOutputs
from services.structured.tokenizer import guidance_tokenizer


class GrammarSet:
    """Compiles constraints for one model's tokenizer (built on first use: ~0.1 s for
    30 k tokens, ~1 s for 150 k) and makes each request's matcher."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int):
        self._args = (tokenizer, list(eos_token_ids), vocab_size)
        self._ll = None
        self._executor = None

    @property
    def ll(self):
        if self._ll is None:
            self._ll = guidance_tokenizer(*self._args)
        return self._ll

    def check(self, constraint: StructuredOutputs) -> str:
        """The grammar text, or ValueError saying why it does not compile."""
        try:
            return constraint.check(self.ll)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from e

    def matcher(self, constraint: StructuredOutputs, produced: list[int]) -> Matcher:
        """A request's matcher, advanced over the tokens it has already produced (a
        resumed or migrated request)."""
        from llguidance import LLMatcher

        m = LLMatcher(self.ll, self.check(constraint), log_level=0)
        if produced and not m.consume_tokens(list(produced)):
            raise ValueError(f"structured_outputs: earlier tokens break it: {m.get_error()}")
        return Matcher(m)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any):
        self.m = matcher

    def accept(self, token: int) -> None:
        """Advance over a sampled token (drawn under this matcher's mask). A token the
        grammar refuses puts it in error: from then on only EOS is allowed."""
        self.m.consume_token(int(token))


_SHIFTS = torch.arange(32, dtype=torch.int32)
_executor = None


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """Set the logits of tokens the grammars forbid to -inf, in place, for ``rows``
    (the masks of all rows computed at once, on llguidance's threads)."""
    global _executor
    from llguidance import LLExecutor
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    if _executor is None:
        _executor = LLExecutor()
    vocab = logits.shape[1]
    bits = allocate_token_bitmask(len(rows), vocab)  # the tokenizer was built this wide
    fill_next_token_bitmask_par(_executor, [(m.m, i) for i, m in enumerate(matchers)], bits)
    allowed = (torch.from_numpy(np.ascontiguousarray(bits)).unsqueeze(-1) >> _SHIFTS) & 1
    allowed = allowed.view(len(rows), -1)[:, :vocab].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
