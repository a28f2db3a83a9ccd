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

    def forced(self, output: list[int]) -> int | None:
        """The token the budget forces next, or None (still free, or the thinking over)."""
        self._scan(output)
        if self.done:
            return None
        k = len(output) - self.budget
        return self.end[k] if 0 <= k < len(self.end) else None

    def _scan(self, output: list[int]) -> None:
        n = len(self.end)
        while not self.done and self._scanned < len(output):
            self._scanned += 1
            self.done = tuple(output[self._scanned - n : self._scanned]) == self.end


def forced_token(req) -> int | None:
    """What ``req``'s thinking budget forces next (None: nothing)."""
    budget = getattr(req, "thinking", None)
    return None if budget is None else budget.forced(req.output_token_ids)
