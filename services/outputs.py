"""Results returned by ``LLM.generate`` and the async engine (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprobs of the raw model distribution for one sampled token."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence; in streaming outputs the fields hold the whole text so far
    and ``text_delta`` / ``token_ids_delta`` hold what is new in this output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> Logprob (the chosen token and the top-n).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    # Prefill role only: the prompt's KV blocks, [2, layers, n, block, kv_heads, head_dim].
    # ``finished`` with no finish_reason then means "handed off to a decode instance".
    kv_blocks: object | None = None
    # Prefill role with a draft head: its hidden rows of the last prompt position [1, A].
    aux_hidden: object | None = None
