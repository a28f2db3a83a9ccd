"""A client request (gRPC or OpenAI) -> a validated, tokenized ``PreparedRequest``."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field

from services.chat import render_chat
from services.engine.input_processor import InputProcessor
from services.engine.request import ImageSpan
from services.models.info import ModelInfo
from services.sampling_params import SamplingParams


class ModelNotFoundError(LookupError):
    """The request names a model this deployment does not serve."""


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]  # placeholders expanded to one id per image token
    params: SamplingParams
    images: list[bytes] = field(default_factory=list)  # encoded files, prompt order
    spans: list[ImageSpan] = field(default_factory=list)
    prompt_text: str | None = None
    deadline: float = 0.0  # unix seconds
    cache_opt_out: bool = False
    # What the semantic cache keys on: the chat messages (or prompt) as text.
    messages: list[dict] | None = None


class RequestPreparer:
    """Tokenizes with the checkpoint's tokenizer and chat template; checks everything."""

    def __init__(self, info: ModelInfo, tokenizer, request_timeout_s: float):
        self.info = info
        self.tokenizer = tokenizer
        self.timeout_s = request_timeout_s
        self.inputs = InputProcessor(tokenizer, info.max_model_len, info.vocab_size,
                                     info.image_token_id, info.tokens_per_image, info.fingerprint)  # fmt: skip

    def check_model(self, model: str) -> None:
        if model and model != self.info.model_id:
            raise ModelNotFoundError(
                f"model {model!r} is not served here (serving {self.info.model_id!r})"
            )

    def prepare(self, *, model: str, params: dict, messages=None, prompt=None, prompt_token_ids=None,
                images=(), request_id: str | None = None, cache_opt_out: bool = False) -> PreparedRequest:  # fmt: skip
        self.check_model(model)
        images = list(images)
        if messages is not None:
            prompt, chat_images = render_chat(self.tokenizer, messages)
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            images = chat_images + images
        elif prompt is None and prompt_token_ids is None:
            raise ValueError(
                "the request has no input: send chat messages, a prompt or prompt_token_ids"
            )
        processed = self.inputs.process(
            {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "images": images}
        )
        sp = self._params(params, len(processed.token_ids))
        raw = [bytes(im) if isinstance(im, bytes | bytearray | memoryview) else im for im in images]
        return PreparedRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex[:16]}",
            prompt_token_ids=processed.token_ids, params=sp, images=raw, spans=processed.spans,
            prompt_text=prompt, deadline=time.time() + self.timeout_s, cache_opt_out=cache_opt_out,
            messages=messages,
        )  # fmt: skip

    def _params(self, kw: dict, prompt_len: int) -> SamplingParams:
        kw = dict(kw)
        room = self.info.max_model_len - prompt_len
        if kw.get("max_tokens") is None:
            kw["max_tokens"] = room
        # Every hop must draw the same random numbers: fix a seed for sampled requests.
        if kw.get("seed") is None and kw.get("temperature", 1.0) > 1e-5:
            kw["seed"] = secrets.randbits(62)
        kw["detokenize"] = False
        return SamplingParams(**kw)
