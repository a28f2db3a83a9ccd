"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from services.structured.outputs import StructuredOutputs

# Seeds travel to the sampler as int64.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    """How one request samples and when it stops. Validated at construction."""

    # Choices generated for the prompt (vLLM's n): they share the prompt's KV blocks and
    # each draws from its own seed stream (``choice_seed``).
    n: int = 1
    # Softmax temperature; 0 means greedy (argmax).
    temperature: float = 1.0
    # Keep the k most likely tokens; 0 or -1 disables.
    top_k: int = 0
    # Nucleus sampling: keep the smallest set whose probability mass reaches top_p.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p * max probability.
    min_p: float = 0.0
    # OpenAI-style penalties over generated tokens, in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF-style multiplicative penalty over prompt and generated tokens, > 0.
    repetition_penalty: float = 1.0
    # Per-request seed: the same seed gives the same tokens whatever the batch.
    seed: int | None = None
    # Maximum number of generated tokens; None means up to the context length.
    max_tokens: int | None = 16
    # No stop condition (EOS, stop ids, stop strings) applies before this many tokens.
    min_tokens: int = 0
    # Extra token ids that end the request (the token is kept in the output).
    stop_token_ids: list[int] = field(default_factory=list)
    # Strings that end the request; the stop string is not part of the text.
    stop: list[str] = field(default_factory=list)
    # Keep generating after EOS.
    ignore_eos: bool = False
    # Number of top logprobs to return per generated token (None: no logprobs).
    logprobs: int | None = None
    # Detokenize while generating. The services turn this off: the gateway detokenizes and
    # applies stop strings itself, then aborts the request on the workers.
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict is read as
    # vLLM's structured_outputs object); enforced token by token in the sampler.
    structured_outputs: StructuredOutputs | None = None
    # A reasoning model's thinking budget (vLLM's thinking_token_budget): after this many
    # output tokens without ``reasoning_end_token_ids``, those ids are forced
    # (services/engine/thinking.py). None: unbounded.
    thinking_token_budget: int | None = None
    reasoning_end_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.reasoning_end_token_ids = [int(t) for t in self.reasoning_end_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 to disable), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must fit in int64, got {self.seed}")
        if self.thinking_token_budget is not None:
            if self.thinking_token_budget < 0:
                raise ValueError(
                    f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}"
                )
            if not self.reasoning_end_token_ids:
                raise ValueError("thinking_token_budget needs reasoning_end_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` (choice 0 keeps it).

    The engine (n > 1 in one process) and the gateway (n fanned out over the fleet)
    derive the same seeds, so a seeded request draws the same choices on either path.
    """
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
