"""Prompt validation, tokenization and image-placeholder expansion."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.request import ImageSpan
from services.image_checks import MAX_IMAGE_PIXELS, image_hash, probe_image
from services.models.image_grid import FixedGrid, ImageGrid, ImageOptions, Placement


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    images: list = field(default_factory=list)  # decoded PIL images, in prompt order
    spans: list[ImageSpan] = field(default_factory=list)
    options: ImageOptions = field(default_factory=ImageOptions)


class InputProcessor:
    """Turns a vLLM-style prompt into checked token ids and image spans.

    ``decode_images=False`` (the gateway) checks image headers only and leaves the
    decode to the encoder; ``images`` of the result is then empty. ``grid`` says how
    many tokens each image takes (services/models/image_grid.py). ``image_boundary``
    (begin, end token ids; Gemma 3): the chat template writes the begin token alone, and
    a text prompt gets "\n\n<begin><image><end>\n\n" in its place before tokenizing,
    as the model's processor does (token-id prompts come with that done).
    """

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        image_token_id=None,
        grid: ImageGrid | None = None,
        fingerprint: str = "",
        decode_images: bool = True,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        image_boundary: tuple[int, int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.image_text = None
        if image_boundary is not None:
            begin, image, end = (
                tokenizer.decode([t], skip_special_tokens=False)
                for t in (image_boundary[0], image_token_id, image_boundary[1])
            )
            self.image_text = (begin, f"\n\n{begin}{image}{end}\n\n")
        self.decode_images = decode_images
        self.max_image_pixels = max_image_pixels
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.grid = grid or FixedGrid(0)
        self.fingerprint = fingerprint

    def process(self, prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        text, ids, raw_images = self._unpack(prompt)
        if ids is None:
            if not text:
                # Special tokens alone (BOS) would make a prompt with nothing to continue.
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(
                self.spell_images(text), add_special_tokens=add_special_tokens
            )
        if not ids:
            raise ValueError("prompt is empty")
        self.check_ids(ids, "prompt")
        extra = prompt if isinstance(prompt, dict) else {}
        options = ImageOptions.of(extra.get("mm_processor_kwargs"))
        if extra.get("image_spans") is not None:
            # Services that already hold the embeddings pass the spans the gateway made.
            ids, spans, images = list(ids), self.check_spans(ids, extra["image_spans"]), []
        else:
            ids, spans, images = self.expand_images(list(ids), raw_images, options)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room to generate in the "
                f"model's context of {self.max_model_len} tokens"
            )
        return ProcessedPrompt(text, ids, images, spans, options)

    def spell_images(self, text: str) -> str:
        """Prompt text as the model's processor hands it to the tokenizer: each image's
        begin token spelled out in full where the model has ``image_boundary``."""
        return text.replace(*self.image_text) if self.image_text else text

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt (the template wrote the special tokens)."""
        return self.tokenizer.encode(self.spell_images(text), add_special_tokens=False)

    def check_ids(self, ids: list, what: str) -> list[int]:
        """``ids`` if every one is a token of this vocabulary, else ValueError."""
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"{what} token ids must be integers in [0, {self.vocab_size})")
        return list(ids)

    def check_spans(self, ids: list[int], spans: list[ImageSpan]) -> list[ImageSpan]:
        """Spans received from another service, if they cover exactly the prompt's image
        placeholders, in order, each shaped as this model shapes an image."""
        tid, end = self.image_token_id, 0
        if spans and tid is None:
            raise ValueError("this model does not accept images")
        for s in spans:
            if s.offset < end or s.length <= 0 or s.offset + s.length > len(ids):
                raise ValueError("image spans overlap or fall outside the prompt")
            if any(t != tid for t in ids[s.offset : s.offset + s.length]):
                raise ValueError("an image span covers tokens that are not image placeholders")
            if not self.grid.check(s.length, tuple(s.grid)):
                raise ValueError(f"an image span of {s.length} tokens (grid {s.grid}) is malformed")
            end = s.offset + s.length
        if tid is not None and ids.count(tid) != sum(s.length for s in spans):
            raise ValueError("the prompt has image placeholders no image span covers")
        return list(spans)

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

    def expand_images(self, ids: list[int], raw_images: list, options: ImageOptions):
        """(ids with each image's placeholder as its tokens, the images' spans, the
        decoded images when this processor decodes them)."""
        tid = self.image_token_id
        n_ph = ids.count(tid) if tid is not None else 0
        if raw_images and tid is None:
            raise ValueError("this model does not accept images")
        if n_ph == 0 and not raw_images:
            return ids, [], []
        images = []
        if self.decode_images:
            from services.images import decode_image  # torch: engine processes only

            images = [decode_image(im) for im in raw_images]
            sizes = [(im.width, im.height) for im in images]
        else:
            headers = [probe_image(im, self.max_image_pixels) for im in raw_images]
            sizes = [(h.width, h.height) for h in headers]
        places = [self.grid.place(w, h, options) for w, h in sizes]
        out, offsets = _placed(ids, tid, places)
        key = self.fingerprint + options.key()
        spans = [
            ImageSpan(o, p.tokens, image_hash(im, key), p.grid)
            for o, p, im in zip(offsets, places, raw_images, strict=True)
        ]
        return out, spans, images


def _placed(ids: list[int], tid: int, places: list[Placement]) -> tuple[list[int], list[int]]:
    """(ids with each image's placeholder expanded to its tokens, each image's offset).
    A prompt whose placeholders already come expanded (token ids from /tokenize or a
    migration) is taken as it is, if each image's tokens sit together."""
    n_ph, total = ids.count(tid), sum(p.tokens for p in places)
    if n_ph == len(places):
        out, offsets, k = [], [], 0
        for t in ids:
            if t == tid:
                offsets.append(len(out))
                out.extend([tid] * places[k].tokens)
                k += 1
            else:
                out.append(t)
        return out, offsets
    if n_ph == total:
        offsets, i = [], 0
        for p in places:
            while ids[i] != tid:
                i += 1
            if ids[i : i + p.tokens] != [tid] * p.tokens:
                raise ValueError("expanded image placeholders do not match the images' sizes")
            offsets.append(i)
            i += p.tokens
        return ids, offsets
    raise ValueError(
        f"the prompt has {n_ph} image placeholders but {len(places)} images were given"
    )
