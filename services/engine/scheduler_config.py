"""The scheduler's per-step limits (``EngineConfig`` fills them in)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SchedulerConfig:
    """Per-step limits of the scheduler. Validated at construction."""

    # Most tokens computed in one step, over all requests (prefill chunks + decodes).
    max_num_batched_tokens: int = 8192
    # Most requests running (holding KV blocks and scheduled) at once.
    max_num_seqs: int = 256
    # Context length: prompt + output tokens of one request never exceed it.
    max_model_len: int
    # Split long prompts over several steps; off, a prompt is admitted whole or not yet.
    enable_chunked_prefill: bool = True
    # Never end a prefill chunk inside an image (models whose image tokens attend to each
    # other both ways, Gemma 3: every one needs the whole image's K/V).
    whole_images: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Otherwise a long prompt could never fit one step and would block the queue.
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
