"""N-gram (prompt lookup) draft proposer: no model, only the request's own tokens.

The longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
that occurred earlier in the request's tokens is looked up; the drafts are the tokens
that followed its most recent earlier occurrence. Continuing past the end of the known
tokens copies the drafts themselves, so a repeating loop of period p < k still yields k
drafts. Works best where outputs copy their input: code edits, extraction, summaries.
"""

from __future__ import annotations

import numpy as np

from services.engine.spec.proposer import ProposeInput


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
        # Earlier occurrences of the last token (ending at p <= length - 2), then how far
        # back each one matches the suffix: one pass over the tokens, not one per n.
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        if ends.size == 0:
            return []
        match = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, length - 1)):
            idx = ends - j
            alive &= idx >= 0
            alive[alive] = seq[idx[alive]] == seq[length - 1 - j]
            match += alive
        best = int(match.max())
        if best < self.min_n:
            return []
        start = int(ends[np.flatnonzero(match == best)[-1]]) + 1  # the most recent longest
        ext = list(tokens)
        for i in range(k):
            ext.append(ext[start + i])
        return ext[length:]
