"""N-gram (prompt lookup) draft proposer: no model, only the request's own tokens.

The longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
that occurred earlier in the request's tokens is looked up; the drafts are the tokens
that followed its most recent earlier occurrence. Continuing past the end of the known
tokens copies the drafts themselves, so a repeating loop of period p < k still yields k
drafts. Works best where outputs copy their input: code edits, extraction, summaries.
"""

from __future__ import annotations

import numpy as np

from services.engine.spec_proposer import ProposeInput


class NgramProposer:
    """Prompt-lookup drafts (``Proposer``): stateless, needs no hidden states."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        """Up to ``k`` drafts per request (none where no suffix n-gram recurs)."""
        return [self.lookup(item.token_ids, k) for item in batch]

    def free(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The drafts for one token sequence."""
        length = len(tokens)
        if k < 1 or length < self.min_n + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every occurrence before the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the most recent occurrence
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + i])
                return ext[length:]
        return []
