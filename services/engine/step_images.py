"""A step's image inputs: each request's image embeddings, the rows of them a step
places, and what image models need besides (M-RoPE positions per axis, the last key each
row of a bidirectional image sees, Qwen3-VL's DeepStack features as per-layer adds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.request import Request
from services.engine.step_meta import to_tensor
from services.models.mrope import rope_positions


class StepImages:
    """Per-request embeddings, and the image inputs of each step's rows."""

    def __init__(self, model, device: torch.device):
        self.device = device
        self.embeds: dict[str, list[torch.Tensor]] = {}
        self.mrope = bool(getattr(model, "uses_mrope", False))
        self.bidirectional = bool(getattr(model, "bidirectional_images", False))

    def add(self, request_id: str, embeds: list[torch.Tensor]) -> None:
        if embeds:
            self.embeds[request_id] = embeds

    def drop(self, request_id: str) -> None:
        self.embeds.pop(request_id, None)

    def lacks(self, req: Request | None) -> bool:
        """Whether a request has image spans but no embeddings here (imported KV)."""
        return req is not None and bool(req.images) and req.request_id not in self.embeds

    def rows(self) -> _StepRows:
        return _StepRows(self)


@dataclass
class _StepRows:
    """What one step's rows need, gathered request by request (``add``)."""

    owner: StepImages
    # (first row in the step, embedding rows [n, width]) of every image part in the step
    mm_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    rope: list[list[int]] = field(default_factory=lambda: [[], [], []])
    last: list[int] = field(default_factory=list)

    def add(self, req: Request, start: int, n: int, row0: int) -> None:
        """Sequence positions start .. start+n-1 of ``req``, at step rows row0 ...."""
        o = self.owner
        if o.mrope:
            for axis, rows in zip(self.rope, rope_positions(req.images, start, n), strict=True):
                axis.extend(rows)
        if o.bidirectional:
            self.last.extend(_last_seen(req.images, start, n))
        # A decode instance holds the spans (positions follow them) but not the embeddings:
        # its imported KV covers the prompt, and a preempted import is failed, not
        # recomputed (LLMEngine.step).
        embeds = o.embeds.get(req.request_id)
        if not req.images or embeds is None:
            return
        for span, emb in zip(req.images, embeds, strict=True):
            lo, hi = max(start, span.offset), min(start + n, span.offset + span.length)
            if lo < hi:
                self.mm_rows.append((row0 + lo - start, emb[lo - span.offset : hi - span.offset]))

    def rope_positions(self) -> torch.Tensor | None:
        """M-RoPE models: [3, T] when a row is an image token, else [T]; None otherwise."""
        if not self.owner.mrope:
            return None
        if self.rope[0] == self.rope[1] == self.rope[2]:  # no image token in the step
            return to_tensor(self.rope[0], torch.long, self.owner.device)
        return torch.tensor(self.rope, dtype=torch.long, device=self.owner.device)

    def last_seen(self, positions: list[int]) -> torch.Tensor | None:
        """[T] the last key each row sees, when a row of the step sees past itself."""
        if not self.last or self.last == positions:
            return None
        return to_tensor(self.last, torch.long, self.owner.device)


def place(embeds: torch.Tensor, mm_rows: list[tuple[int, torch.Tensor]]) -> dict:
    """Write the image rows into the step's input embeddings; the model's extra inputs
    (``layer_adds``: columns past the hidden size, Qwen3-VL's DeepStack features)."""
    width, extra = embeds.shape[1], []
    for row, emb in mm_rows:
        embeds[row : row + emb.shape[0]] = emb[:, :width].to(embeds.dtype)
        if emb.shape[1] > width:
            extra.append((row, emb[:, width:]))
    if not extra:
        return {}
    rows = torch.cat([torch.arange(r, r + e.shape[0]) for r, e in extra]).to(embeds.device)
    values = torch.cat([e for _, e in extra])
    return {"layer_adds": (rows, values.view(values.shape[0], -1, width).transpose(0, 1))}


def _last_seen(spans, start: int, n: int) -> list[int]:
    """The last key position rows start .. start+n-1 see: their own, or for a row inside
    an image, the image's last (the scheduler keeps each image in one chunk)."""
    out = list(range(start, start + n))
    for s in spans:
        for p in range(max(start, s.offset), min(start + n, s.offset + s.length)):
            out[p - start] = s.offset + s.length - 1
    return out
