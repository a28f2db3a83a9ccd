"""``POST /v1/completions``."""

from __future__ import annotations

from starlette.responses import Response

from gateway.models import ModelSet
from gateway.rest.middleware import Call
from gateway.rest.protocol import CompletionRequest
from gateway.rest.responses import completion_logprobs
from gateway.rest.serving import CompletionRun, finish_reason
from gateway.stream import Delta, OutputStream


class TextRenderer:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, tokenizer, n: int, logprobs: bool, echo: list[str] | None):
        self.tokenizer, self.n, self.logprobs = tokenizer, n, logprobs
        self.echo = echo  # each prompt's text, when echoed
        self._offsets: dict[tuple[int, int], int] = {}  # characters sent per choice

    def _prefix(self, prompt: int) -> str:
        return self.echo[prompt] if self.echo else ""

    def choice(self, prompt: int, stream: OutputStream) -> dict:
        prefix = self._prefix(prompt)
        lps = (
            completion_logprobs(self.tokenizer, stream.logprobs, len(prefix))
            if self.logprobs
            else None
        )
        return {
            "index": prompt * self.n + stream.index,
            "text": prefix + stream.text,
            "logprobs": lps,
            "finish_reason": finish_reason(stream),
        }

    def chunk_choice(self, prompt: int, delta: Delta, stream: OutputStream, first: bool) -> dict:
        text = (self._prefix(prompt) if first else "") + delta.text
        key = (prompt, delta.index)
        offset = self._offsets.get(key, 0)
        self._offsets[key] = offset + len(text)
        lps = None
        if self.logprobs and delta.token_ids:
            lps = completion_logprobs(
                self.tokenizer, delta.logprobs, offset + len(text) - len(delta.text)
            )
        return {
            "index": prompt * self.n + delta.index,
            "text": text,
            "logprobs": lps,
            "finish_reason": finish_reason(stream) if delta.finish_reason else None,
        }


async def completion(models: ModelSet, req: CompletionRequest, call: Call) -> Response:
    """Every prompt of the request runs on the model its first prompt resolves to."""
    req.check_supported()
    params = req.sampling_kwargs(req.max_tokens)
    params["structured_outputs"], constraint_param = req.constraint()
    params["logprobs"] = req.logprobs
    preps, core, model = [], None, req.model or ""
    for prompt in req.prompts():
        text = prompt if isinstance(prompt, str) else None
        ids = None if isinstance(prompt, str) else list(prompt)
        kwargs = dict(
            model=model,
            params=params,
            prompt=text,
            prompt_token_ids=ids,
            request_id=call.client_id,
            tenant=call.tenant(req.user),
            cache_mode=call.cache_mode,
            session_key=call.session or req.user or "",
            constraint_param=constraint_param,
        )
        if core is None:
            core, prep = await models.prepare(**kwargs)
            model = core.info.model_id
        else:  # the same model, and the semantic router's guards see every prompt
            core, prep = await models.prepare(**{**kwargs, "model": model})
        preps.append(prep)
    echo = None
    if req.echo:
        echo = [
            p.prompt_text
            if p.prompt_text is not None
            else core.tokenizer.decode(p.prompt_token_ids)
            for p in preps
        ]
    renderer = TextRenderer(core.tokenizer, req.n, req.logprobs is not None, echo)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await CompletionRun(core, preps, renderer).respond(
        req.stream, include_usage, call.headers
    )
