"""Prompt validation, tokenization and image-placeholder expansion."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.request import ImageSpan
from services.image_checks import MAX_IMAGE_PIXELS, image_hash, probe_image


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    images: list = field(default_factory=list)  # decoded PIL images, in prompt order
    spans: list[ImageSpan] = field(default_factory=list)


class InputProcessor:
    """Turns a vLLM-style prompt into checked token ids and image spans.

    ``decode_images=False`` (the gateway) checks image headers only and leaves the
    decode to the encoder; ``images`` of the result is then empty.
    """

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        image_token_id=None,
        tokens_per_image: int = 0,
        fingerprint: str = "",
        decode_images: bool = True,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        self.tokenizer = tokenizer
        self.decode_images = decode_images
        self.max_image_pixels = max_image_pixels
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.fingerprint = fingerprint

    def process(self, prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        text, ids, raw_images = self._unpack(prompt)
        if ids is None:
            if not text:
                # Special tokens alone (BOS) would make a prompt with nothing to continue.
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError("prompt is empty")
        self.check_ids(ids, "prompt")
        # Services that already hold the embeddings pass image hashes instead of images.
        hashes = prompt.get("image_hashes") if isinstance(prompt, dict) else None
        ids, spans, images = self._expand_images(list(ids), raw_images, hashes)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room to generate in the "
                f"model's context of {self.max_model_len} tokens"
            )
        return ProcessedPrompt(text, ids, images, spans)

    def check_ids(self, ids: list, what: str) -> list[int]:
        """``ids`` if every one is a token of this vocabulary, else ValueError."""
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"{what} token ids must be integers in [0, {self.vocab_size})")
        return list(ids)

    @staticmethod
    def _unpack(prompt):
        if isinstance(prompt, str):
            return prompt, None, []
        if not isinstance(prompt, dict):
            raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")
        images = prompt.get("images")
        if images is None:
            images = (prompt.get("multi_modal_data") or {}).get("image", [])
        if not isinstance(images, list | tuple):
            images = [images]
        if prompt.get("prompt_token_ids") is not None:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), list(images)
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], None, list(images)
        raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids'")

    def _expand_images(self, ids: list[int], raw_images: list, hashes: list[str] | None = None):
        tid = self.image_token_id
        n_ph = ids.count(tid) if tid is not None else 0
        n_img = len(hashes) if hashes is not None else len(raw_images)
        if n_img and tid is None:
            raise ValueError("this model does not accept images")
        if n_ph == 0 and not n_img:
            return ids, [], []
        n = self.tokens_per_image
        expanded = n_ph == n_img * n and n > 1 and _runs_of(ids, tid, n)
        if not expanded and n_ph != n_img:
            raise ValueError(
                f"the prompt has {n_ph} image placeholders but {n_img} images were given"
            )
        images = []
        if hashes is None:
            if self.decode_images:
                from services.images import decode_image  # torch: engine processes only

                images = [decode_image(im) for im in raw_images]
            else:
                for im in raw_images:
                    probe_image(im, self.max_image_pixels)
            hashes = [image_hash(im, self.fingerprint) for im in raw_images]
        if expanded:
            # Runs are multiples of n: every n-th placeholder starts an image.
            offsets = [i for i, t in enumerate(ids) if t == tid][::n]
            out = ids
        else:
            out, offsets = [], []
            for t in ids:
                if t == tid:
                    offsets.append(len(out))
                    out.extend([tid] * n)
                else:
                    out.append(t)
        spans = [ImageSpan(o, n, h) for o, h in zip(offsets, hashes, strict=True)]
        return out, spans, images


def _runs_of(ids: list[int], tid: int, n: int) -> bool:
    """True when the placeholder ids already come as runs of exactly n (pre-expanded)."""
    run = 0
    for t in ids + [None]:
        if t == tid:
            run += 1
        elif run:
            if run % n:
                return False
            run = 0
    return True
