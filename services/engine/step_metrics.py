"""The engine's metrics, fed from each step (services/metrics.py defines them): queue
time, prefill time, batch size, prompt / prefix-cached / generated tokens, preemptions.
Torch-free; the times are ``time.monotonic()`` like ``Request.arrival_time``."""

from __future__ import annotations

import time

from services.engine.scheduler_output import SchedulerOutput
from services.metrics import (
    BATCH_SIZE,
    ENGINE_CACHED_TOKENS,
    ENGINE_GENERATED_TOKENS,
    ENGINE_PROMPT_TOKENS,
    PREEMPTIONS,
    PREFILL_TIME,
    QUEUE_TIME,
)


def observe_scheduled(so: SchedulerOutput) -> None:
    """Before the step runs: batch size, and each request's first scheduling (its queue
    time; for a prompt computed here, its prompt and prefix-cache hit tokens)."""
    if so.is_empty:
        return
    now = time.monotonic()
    BATCH_SIZE.observe(len(so.scheduled))
    if so.preempted_ids:
        PREEMPTIONS.inc(len(so.preempted_ids))
    for item in so.scheduled:
        req = item.request
        if req.first_scheduled_time is not None:
            continue
        req.first_scheduled_time = now
        QUEUE_TIME.observe(now - req.arrival_time)
        # KV imported from a prefill instance starts past the prompt: no prefill here.
        if item.start < req.num_prompt_tokens:
            req.prefill_start_time = now
            ENGINE_PROMPT_TOKENS.inc(req.num_prompt_tokens)
            ENGINE_CACHED_TOKENS.inc(req.num_cached_tokens)


def observe_step(so: SchedulerOutput, new_tokens: dict[str, list[int]]) -> None:
    """After the step: tokens sampled, and the prefill time of prompts that produced
    their first token."""
    now = time.monotonic()
    ENGINE_GENERATED_TOKENS.inc(sum(len(t) for t in new_tokens.values()))
    for item in so.scheduled:
        req = item.request
        if item.sample and req.prefill_start_time is not None:
            PREFILL_TIME.observe(now - req.prefill_start_time)
            req.prefill_start_time = None
