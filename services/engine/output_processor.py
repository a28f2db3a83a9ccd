"""Per-request output state: incremental text, stop strings, logprobs, RequestOutputs."""

from __future__ import annotations

from services.engine.request import Request
from services.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from services.sampling_params import SamplingParams
from services.tokenization import IncrementalDetokenizer


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt,
        prompt_ids,
        params: SamplingParams,
        tokenizer,
        final_only: bool = False,
        index: int = 0,
    ):
        self.request_id = request_id
        # Which choice of an n > 1 request this is (CompletionOutput.index).
        self.index = index
        # Only the finished output is wanted (offline ``LLM.generate``): no per-step outputs,
        # and without stop strings the text is decoded once at the end.
        self.final_only = final_only
        self.lazy_text = final_only and not params.stop
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
            if params.detokenize
            else None
        )
        self.text = ""
        self.sent_chars = 0
        self.token_ids: list[int] = []
        self.sent_tokens = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cum_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # Prefill role: the request continues on a decode instance.
        self.handed_off = False
        # The tokens that make text: all but a final stop token (None: all).
        self.text_tokens: int | None = None

    def append(self, token: int, lp: TokenLogprobs | None, text: bool = True) -> str | None:
        """Add one token; returns the stop string it completed, if any. ``text`` False:
        the token that stopped the request (EOS, a stop token id), which adds no text,
        as in vLLM (a parser reading the text never sees an end-of-text marker)."""
        self.token_ids.append(token)
        if lp is not None and self.logprobs is not None:
            self.logprobs.append(self._logprob_dict(lp))
            self.cum_logprob += lp.logprob
        if not text:
            self.text_tokens = len(self.token_ids) - 1
            return None
        if self.detok is None or self.lazy_text:
            return None
        old = len(self.text)
        self.text += self.detok.add([token])
        if not self.params.stop or len(self.token_ids) < self.params.min_tokens:
            return None
        return self._find_stop(old)

    def resume(self, tokens: list[int]) -> None:
        """A migrated request: the tokens its client already has, already sent. Their
        logprobs went out with them; empty entries keep positions aligned."""
        for token in tokens:
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append({})
            if self.detok is not None and not self.lazy_text:
                self.text += self.detok.add([token])
        self.sent_tokens, self.sent_chars = len(self.token_ids), len(self.text)

    def _find_stop(self, old_len: int) -> str | None:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, old_len - longest + 1)
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        self.text = self.text[:idx]
        return stop

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        def dec(t: int) -> str:
            return self.tokenizer.decode([t]) if self.tokenizer is not None else ""

        out = {t: Logprob(v, r + 1, dec(t)) for r, (t, v) in enumerate(lp.top)}
        out.setdefault(lp.token_id, Logprob(lp.logprob, lp.rank, dec(lp.token_id)))
        return out

    def finish(self, reason: str, stop_reason=None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason
        if self.lazy_text and self.detok is not None:
            self.text += self.detok.add(self.token_ids[: self.text_tokens])
            self.text += self.detok.flush()
            self.lazy_text = False

    def wants_output(self) -> bool:
        return not self.final_only or self.finish_reason is not None or self.handed_off

    def take_text(self) -> str:
        """The text not sent yet that may go out now (marked sent)."""
        done = self.finish_reason is not None or self.handed_off
        # While running, hold back text that may still turn out to start a stop string.
        hold = 0 if done or not self.params.stop else max(len(s) for s in self.params.stop) - 1
        visible = max(self.sent_chars, len(self.text) - hold)
        delta = self.text[self.sent_chars : visible]
        self.sent_chars = visible
        return delta

    def make_output(self) -> RequestOutput:
        done = self.finish_reason is not None or self.handed_off
        delta = self.take_text()
        new_ids = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        comp = CompletionOutput(
            index=self.index,
            text=self.text[: self.sent_chars],
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cum_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            text_delta=delta,
            token_ids_delta=new_ids,
        )
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_ids, [comp], done, self.num_cached_tokens
        )


def finish_reason_of(req: Request) -> str:
    return req.status.value
