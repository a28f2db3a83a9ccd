"""Chat messages -> (template text, images), shared by ``LLM.chat`` and the gateway."""

from __future__ import annotations

import base64
import binascii

from jinja2 import TemplateError

from services.image_checks import ImageError

_IMAGE_TYPES = ("image", "image_url", "input_image")


def _data_url_bytes(url: str) -> bytes:
    if not url.startswith("data:") or ";base64," not in url:
        raise ImageError("only data: URLs with base64 images are accepted (no downloads)")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 image data: {e}") from e


def part_image(part: dict):
    """The image payload of one content part: PIL image or bytes."""
    if part.get("image") is not None:
        return part["image"]
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if isinstance(url, str):
        return _data_url_bytes(url)
    raise ImageError("image content part carries no image")


def split_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """Messages for the chat template (image parts reduced to {"type": "image"}) + images."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out, images = [], []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message needs a role")
        content = m.get("content")
        # Other keys (tool_calls, tool_call_id, name...) are the template's to read.
        rest = {k: v for k, v in m.items() if k != "content"}
        if content is None or isinstance(content, str):
            out.append({**rest, "content": content or ""})
            continue
        parts = []
        for part in content:
            if part.get("type") in _IMAGE_TYPES:
                images.append(part_image(part))
                parts.append({"type": "image"})
            elif part.get("type") == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"unsupported content part type {part.get('type')!r}")
        out.append({**rest, "content": parts})
    return out, images


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
) -> tuple[str, list]:
    """Apply the checkpoint's chat template (``template_kwargs``: ``tools`` and the
    request's chat_template_kwargs); returns (prompt text, images in order)."""
    msgs, images = split_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; send a raw prompt instead")
    try:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except TemplateError as e:  # the template refused these messages (roles, tools...)
        raise ValueError(f"messages: the chat template refused them: {e}") from e
    return text, images
