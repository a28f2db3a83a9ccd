"""Gateway-side output of one request: incremental text, stop strings, usage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.events import TokenEvent
from gateway.prepare import PreparedRequest
from services.engine.output_processor import RequestState
from services.outputs import TokenLogprobs


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None
    stop_reason: int | str | None
    index: int = 0  # the choice


class OutputStream:
    """Feeds tokens from the workers through the detokenizer and the stop strings.

    ``stopped`` turns true when a stop string ended the request here: the caller must
    abort it on the workers, which do not know stop strings.
    """

    def __init__(self, prep: PreparedRequest, tokenizer, index: int = 0):
        params = dataclasses.replace(prep.params, detokenize=True)
        self.index = index
        self.state = RequestState(
            prep.request_id, prep.prompt_text, prep.prompt_token_ids, params, tokenizer, index=index
        )
        self.num_cached_tokens = 0
        self.stopped = False
        self._lps: list[TokenLogprobs | None] = []

    @property
    def finished(self) -> bool:
        return self.state.finish_reason is not None

    def add(self, event: TokenEvent) -> Delta:
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        start = len(self.state.token_ids)
        # A token that stopped the request (EOS, a stop token id) adds no text.
        by_token = event.finish_reason == "stop" and not isinstance(event.stop_reason, str)
        last = len(event.token_ids) - 1
        for i, tok in enumerate(event.token_ids):
            if self.finished:
                break
            lp = event.logprobs[i] if i < len(event.logprobs) else None
            self._lps.append(lp)
            stop = self.state.append(tok, None, text=not (by_token and i == last))
            if stop is not None:
                self.state.finish("stop", stop)
                self.stopped = True
        if event.finish_reason is not None:
            self.state.finish(event.finish_reason, event.stop_reason)
        new = self.state.token_ids[start:]
        return Delta(
            new,
            self.state.take_text(),
            self._lps[start : start + len(new)],
            self.state.finish_reason,
            self.state.stop_reason,
            self.index,
        )

    @property
    def text(self) -> str:
        return self.state.text

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        return self._lps
