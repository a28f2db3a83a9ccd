"""A client request (gRPC or OpenAI) -> a validated, tokenized ``PreparedRequest``."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field

from gateway.chat_message import ChatParsers
from gateway.chat_output import ChatOptions, ChatOutputs
from gateway.config import GatewayConfig
from gateway.request_errors import InvalidRequest, ModelNotFoundError
from services.chat import render_chat
from services.engine.input_processor import InputProcessor
from services.engine.request import ImageSpan
from services.models.image_grid import ImageOptions
from services.models.info import ModelInfo
from services.sampling_params import SamplingParams

__all__ = ["InvalidRequest", "ModelNotFoundError", "PreparedRequest", "RequestPreparer"]


@dataclass
class PreparedRequest:
    # The fleet's key for this request: generated here, unique, never the client's id.
    request_id: str
    prompt_token_ids: list[int]  # placeholders expanded to one id per image token
    params: SamplingParams
    images: list[bytes] = field(default_factory=list)  # encoded files, prompt order
    spans: list[ImageSpan] = field(default_factory=list)
    # The request's mm_processor_kwargs (the images' hashes include them).
    image_options: ImageOptions = field(default_factory=ImageOptions)
    prompt_text: str | None = None
    deadline: float = 0.0  # unix seconds
    cache_opt_out: bool = False
    # What the semantic cache keys on: the chat messages (or prompt) as text.
    messages: list[dict] | None = None
    # The client's own id (X-Request-Id, gRPC request_id): only echoed back.
    client_request_id: str | None = None
    # Semantic cache: whose answers it may share (API key or `user`), the client's
    # x-epd-cache mode ("default", "no-cache", "no-store", "bypass"), and what it did.
    tenant: str = ""
    cache_mode: str = "default"
    cache_status: str = "miss"  # "hit-exact", "hit-semantic", "miss"
    cache_similarity: float | None = None
    # The cache replica that began embedding the question at the exact miss: the full
    # lookup goes to it. Empty: any replica.
    cache_replica: str = ""
    # Routing affinity (consistent_hash policy): the x-session-id header, else `user`.
    session_key: str = ""
    # What the semantic router did, as response headers (x-epd-model, x-epd-route,
    # x-epd-guard; gateway/semantic_router/hook.py).
    route_headers: dict[str, str] = field(default_factory=dict)
    # The router's embedding of the last user message (float32 bytes): the semantic
    # cache uses it instead of embedding the same text again. Empty: none.
    text_vector: bytes = b""
    # A chat request's tools, template keywords and thinking budget (the cache keys by
    # them), and what reads its answer back (gateway/chat_message.py).
    chat_key: str = ""
    parsers: ChatParsers = field(default_factory=ChatParsers)


# The x-epd-cache request header: default; no-cache (do not read the semantic cache, store
# the answer); no-store (read, do not store); bypass (neither).
CACHE_MODES = ("default", "no-cache", "no-store", "bypass")


def _check_cache_mode(mode: str) -> None:
    if mode not in CACHE_MODES:
        raise InvalidRequest(
            f"x-epd-cache must be one of {', '.join(CACHE_MODES)}, got {mode!r}", "x-epd-cache"
        )


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class RequestPreparer:
    """Tokenizes with the checkpoint's tokenizer and chat template; checks everything.

    Images get header-only checks here; their pixels are decoded by the encoder.
    """

    def __init__(
        self,
        info: ModelInfo,
        tokenizer,
        request_timeout_s: float,
        limits: GatewayConfig | None = None,
    ):
        self.info = info
        self.tokenizer = tokenizer
        self.timeout_s = request_timeout_s
        self.limits = limits or GatewayConfig()
        self.defaults = info.default_sampling()
        self.outputs = ChatOutputs(
            tokenizer,
            self.limits.tool_call_parser,
            self.limits.enable_auto_tool_choice,
            self.limits.reasoning_parser,
        )
        self.inputs = InputProcessor(
            tokenizer,
            info.max_model_len,
            info.vocab_size,
            info.image_token_id,
            info.image_grid,
            info.fingerprint,
            decode_images=False,
            max_image_pixels=self.limits.max_image_pixels,
            image_boundary=info.image_boundary,
        )

    def check_model(self, model: str) -> None:
        if model and model != self.info.model_id:
            raise ModelNotFoundError(
                f"model {model!r} is not served here (serving {self.info.model_id!r})"
            )

    def prepare(
        self,
        *,
        model: str,
        params: dict,
        messages=None,
        prompt=None,
        prompt_token_ids=None,
        images=(),
        request_id: str | None = None,
        cache_opt_out: bool = False,
        add_special_tokens: bool = True,
        tenant: str = "",
        cache_mode: str = "default",
        session_key: str = "",
        chat: ChatOptions | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> PreparedRequest:
        """``params``: SamplingParams keywords the client set (unset ones take the
        checkpoint's generation_config.json defaults). Raises InvalidRequest, ValueError
        (bad values), ModelNotFoundError."""
        self.check_model(model)
        _check_cache_mode(cache_mode)
        images = list(images)
        parsers, chat_key = ChatParsers(), ""
        if messages is not None:
            chat = chat or ChatOptions()
            prompt, chat_images, params, parsers = self._chat(messages, chat, params)
            prompt_token_ids = self.inputs.encode_chat(prompt)
            images, chat_key = chat_images + images, chat.key()
        elif prompt is None and prompt_token_ids is None:
            raise InvalidRequest(
                "the request has no input: send chat messages, a prompt or prompt_token_ids"
            )
        processed = self._process(
            prompt, prompt_token_ids, images, mm_processor_kwargs, add_special_tokens
        )
        sp = self._params(params, len(processed.token_ids))
        raw = [bytes(im) for im in images]
        return PreparedRequest(
            request_id=new_request_id(),
            prompt_token_ids=processed.token_ids,
            params=sp,
            images=raw,
            spans=processed.spans,
            image_options=processed.options,
            prompt_text=prompt,
            deadline=time.time() + self.timeout_s,
            cache_opt_out=cache_opt_out,
            messages=messages,
            client_request_id=request_id,
            tenant=tenant,
            cache_mode=cache_mode,
            session_key=session_key,
            chat_key=chat_key,
            parsers=parsers,
        )

    def _process(self, prompt, prompt_token_ids, images, mm_processor_kwargs, special: bool):
        """The prompt's token ids and image spans (image limits checked first)."""
        self._check_images(images)
        return self.inputs.process(
            {
                "prompt": prompt,
                "prompt_token_ids": prompt_token_ids,
                "images": images,
                "mm_processor_kwargs": mm_processor_kwargs,
            },
            special,
        )

    def _chat(self, messages: list[dict], chat: ChatOptions, params: dict):
        """The chat template applied (with the request's tools and keywords); the
        params with what the engine must enforce; the parsers that read the answer."""
        prompt, images = render_chat(
            self.tokenizer, messages, tools=chat.tools, **chat.template_kwargs
        )
        params = dict(params)
        return prompt, images, params, self.outputs.plan(chat, params, prompt)

    def _check_images(self, images: list) -> None:
        lim = self.limits
        if len(images) > lim.max_images:
            raise InvalidRequest(
                f"{len(images)} images in one request; at most {lim.max_images}", "messages"
            )
        for im in images:
            if not isinstance(im, bytes | bytearray | memoryview):
                raise InvalidRequest("images must be encoded image files (bytes)", "messages")
            if len(im) > lim.max_image_bytes:
                raise InvalidRequest(
                    f"an image of {len(im)} bytes is over the limit of {lim.max_image_bytes}",
                    "messages",
                )

    def _params(self, given: dict, prompt_len: int) -> SamplingParams:
        kw = {**self.defaults, **{k: v for k, v in given.items() if v is not None}}
        self._check_limits(kw)
        room = self.info.max_model_len - prompt_len
        if kw.get("max_tokens") is None:
            kw["max_tokens"] = room
        elif kw["max_tokens"] > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.info.max_model_len} tokens. "
                f"However, you requested {prompt_len + kw['max_tokens']} tokens "
                f"({prompt_len} in the prompt, {kw['max_tokens']} in the completion). "
                "Please reduce the length of the prompt or of the completion.",
                "max_tokens",
            )
        # Every hop must draw the same random numbers: fix a seed for sampled requests.
        if kw.get("seed") is None and kw.get("temperature", 1.0) > 1e-5:
            kw["seed"] = secrets.randbits(62)
        kw["detokenize"] = False
        return SamplingParams(**kw)

    def _check_limits(self, kw: dict) -> None:
        lim = self.limits
        n = kw.get("n", 1)
        if isinstance(n, int) and n > lim.max_n:
            raise InvalidRequest(f"n must be at most {lim.max_n}, got {n}", "n")
        stop = kw.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if len(stop) > lim.max_stop:
            raise InvalidRequest(f"{len(stop)} stop strings; at most {lim.max_stop}", "stop")
        ids = kw.get("stop_token_ids") or []
        if len(ids) > lim.max_stop_token_ids:
            raise InvalidRequest(
                f"{len(ids)} stop_token_ids; at most {lim.max_stop_token_ids}", "stop_token_ids"
            )
        if any(isinstance(s, str) and len(s) > lim.max_stop_chars for s in stop):
            raise InvalidRequest(
                f"a stop string is longer than {lim.max_stop_chars} characters", "stop"
            )
