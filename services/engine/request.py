"""Long-lived per-request state, torch-free (the scheduler and block manager use it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from services.engine.thinking import ThinkingBudget
from services.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's embedding rows sit in the prompt."""

    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens (= embedding rows)
    image_hash: str  # sha256 hex of the image bytes (+ preprocessing / model fingerprint)
    # (t, h, w) of its tokens where the decoder's rotary positions follow the image's
    # layout (M-RoPE: services/models/mrope.py); () otherwise.
    grid: tuple[int, ...] = ()


@dataclass
class Request:
    """One generation request as the engine core sees it.

    "Tokens known" are prompt + generated tokens; "tokens computed" are those whose KV
    is in the cache. Prefill, chunked prefill and decode are all "compute the next
    tokens known but not computed yet" (STYLE.md 3).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    images: list[ImageSpan] = field(default_factory=list)
    arrival_time: float = 0.0
    # Upper bound on prompt + output tokens (the model's context length).
    max_model_len: int = 1 << 30

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens found in the prefix cache when the request was (re)admitted.
    num_cached_tokens: int = 0
    # Block ids, in order; append-only while the request holds them.
    block_ids: list[int] = field(default_factory=list)
    # Hybrid models: the slot of its recurrent state, held with its blocks (mamba_state.py).
    state_slot: int | None = None
    # sha256 hex of each full block of all_token_ids, chained from the parent.
    block_hashes: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding: draft tokens proposed for the next step (set by the engine
    # before scheduling, consumed by it); never part of all_token_ids or block hashes.
    spec_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Metrics (step_metrics.py): when first scheduled; when its prompt started computing
    # here (None once the first token is out, or when the KV was imported).
    first_scheduled_time: float | None = None
    prefill_start_time: float | None = None
    # Structured outputs: this request's matcher (services/structured/matcher.py), which
    # the sampler masks by and advances; None when unconstrained.
    grammar: Any = None
    # The thinking budget (services/engine/thinking.py); None when unbounded.
    thinking: ThinkingBudget | None = field(init=False)

    def __post_init__(self) -> None:
        self.thinking = ThinkingBudget.of(self.sampling_params)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_total_tokens(self) -> int:
        """Prompt + the most output tokens this request may reach."""
        limit = self.max_model_len
        if self.sampling_params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.sampling_params.max_tokens)
        return limit

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
