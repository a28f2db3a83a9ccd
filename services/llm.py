"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from services.chat import render_chat
from services.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.outputs import RequestOutput
from services.sampling_params import SamplingParams


class LLM:
    """Synchronous batch generation over the engine.

    ``LLM("demo")`` runs the built-in tiny VLM; any other ``model`` is a Hugging Face
    checkpoint directory. Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str = "demo", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults."""
        return SamplingParams(**self.engine.loaded.info.default_sampling())

    def generate(
        self, prompts, sampling_params=None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Prompts (a string, a dict, or a list of them) -> one finished output each, in order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, sp, final_only=True)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(self, messages, sampling_params=None, add_generation_prompt: bool = True):
        """One conversation (list of messages) or a list of them -> outputs."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text, images = render_chat(self.tokenizer, conv, add_generation_prompt)
            ids = self.engine.inputs.encode_chat(text)
            prompts.append({"prompt": text, "prompt_token_ids": ids, "images": images})
        return self.generate(prompts, sampling_params)

    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if isinstance(sp, Sequence) and len(sp) == n:
            return list(sp)
        raise ValueError("sampling_params must be one SamplingParams or one per prompt")

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
