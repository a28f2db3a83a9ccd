"""A reasoning model's thinking budget: after ``thinking_token_budget`` output tokens
still inside the thinking, the end-of-thinking tokens are forced, one per step.

The state is a function of the output tokens alone (scanned once each), so a resumed,
migrated or recomputed request needs nothing carried over. The end is recognised by its
token ids: the models that think (Qwen3, DeepSeek-R1, Nemotron) write ``</think>`` as
one added token, the tokenization their chat template and the gateway use.
"""

from __future__ import annotations

from services.sampling_params import SamplingParams


class ThinkingBudget:
    def __init__(self, budget: int, end: list[int]):
        self.budget, self.end = budget, tuple(end)
        self._scanned = 0  # output tokens looked at for the end
        self.done = False  # the thinking has ended (by the model or forced)

    @classmethod
    def of(cls, sp: SamplingParams) -> ThinkingBudget | None:
        if sp.thinking_token_budget is None:
            return None
        return cls(sp.thinking_token_budget, sp.reasoning_end_token_ids)

    def pending(self, output: list[int]) -> bool:
        """Whether the thinking may still be cut (it has not ended)."""
        self._scan(output)
        return not self.done

    def forced(self, output: list[int]) -> int | None:
        """The token the budget forces next, or None (still free, or the thinking over).
        Past the budget, the end's next token after the part of it already written (a
        step that ran past the budget, or a model that began the tag itself)."""
        if not self.pending(output) or len(output) < self.budget:
            return None
        since = output[self.budget :]
        written = next(
            m
            for m in range(min(len(self.end) - 1, len(since)), -1, -1)
            if tuple(since[len(since) - m :]) == self.end[:m]
        )
        return self.end[written]

    def _scan(self, output: list[int]) -> None:
        n = len(self.end)
        while not self.done and self._scanned < len(output):
            self._scanned += 1
            self.done = tuple(output[self._scanned - n : self._scanned]) == self.end


def forced_token(req) -> int | None:
    """What ``req``'s thinking budget forces next (None: nothing)."""
    budget = getattr(req, "thinking", None)
    return None if budget is None else budget.forced(req.output_token_ids)


def thinking_pending(req) -> bool:
    """Whether ``req`` has a thinking budget that may still cut its thinking (no bursts
    or drafts for it: the forced end must land at its position)."""
    budget = getattr(req, "thinking", None)
    return budget is not None and budget.pending(req.output_token_ids)
