"""The small endpoints: models, tokenize / detokenize."""

from __future__ import annotations

import time

from starlette.responses import JSONResponse, Response

from gateway.chat_output import ChatOptions
from gateway.core import GatewayCore
from gateway.prepare import InvalidRequest
from gateway.rest.chat import resolve_messages
from gateway.rest.media import MediaLoader
from gateway.rest.protocol import DetokenizeRequest, TokenizeRequest
from services.chat import render_chat
from services.models.image_grid import ImageOptions

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def model_card(core: GatewayCore) -> dict:
    info = core.info
    return {
        "id": info.model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "epd-serve",
        "root": info.model_id,
        "max_model_len": info.max_model_len,
        "vision": info.vision,
        # What a request may ask of this server beyond text (docs/structured-outputs.md).
        "structured_outputs": list(STRUCTURED_KINDS),
        # The tool-call and reasoning formats the server reads (False: none).
        "tool_calling": _tool_calling(core.config),
        "reasoning": core.config.reasoning_parser or False,
    }


def _tool_calling(config) -> dict | bool:
    if not config.tool_call_parser:
        return False
    choices = ["none", "required", "function"]
    choices += ["auto"] if config.enable_auto_tool_choice else []
    return {"parser": config.tool_call_parser, "tool_choice": choices}


async def tokenize(
    core: GatewayCore, media: MediaLoader, req: TokenizeRequest, headers: dict
) -> Response:
    """Token ids as the model sees them: each image of the messages (loaded as a chat
    request loads it) as many placeholder tokens as its size gives; in a raw prompt (no
    images), each placeholder as a fixed grid's count (a size-dependent model's stay
    single: no image, no size)."""
    core.preparer.check_model(req.model or "")
    tok, inputs = core.tokenizer, core.preparer.inputs
    images: list = []
    if req.messages is not None:
        messages = await resolve_messages(media, req.messages)
        options = ChatOptions.of(req.tools, "none", template_kwargs=req.chat_template_kwargs)
        kwargs = {"tools": options.tools, **options.template_kwargs}
        text, images = render_chat(tok, messages, req.add_generation_prompt, **kwargs)
        ids = inputs.encode_chat(text)
    else:
        ids = tok.encode(inputs.spell_images(req.prompt), add_special_tokens=req.add_special_tokens)
    image_id, per_image = core.info.image_token_id, core.info.tokens_per_image
    if images:
        ids = inputs.expand_images(ids, images, ImageOptions())[0]
    elif image_id is not None and per_image > 1:
        ids = [t for i in ids for t in ([i] * per_image if i == image_id else [i])]
    body = {"count": len(ids), "max_model_len": core.info.max_model_len, "tokens": ids}
    return JSONResponse(body, headers=headers)


async def detokenize(core: GatewayCore, req: DetokenizeRequest, headers: dict) -> Response:
    core.preparer.check_model(req.model or "")
    vocab = core.info.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequest(f"tokens must be ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": core.tokenizer.decode(req.tokens)}, headers=headers)
