"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL / Qwen3-VL): where each
token of a sequence sits for the decoder's rotary embedding.

Text tokens move one position per token. An image's tokens form a (1, h, w) grid (one
frame: the spans are checked to have t = 1) that starts at the position after the text
before it; token (0, j, k) of the grid has positions (start, start + j, start + k) on
the three rotary axes, and the text after the image resumes at start + max(h, w). So
every token past an image sits max(h, w) - h·w positions from its index in the sequence.
The rule is transformers' ``get_rope_index`` for images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.engine.request import ImageSpan


def rope_positions(spans: Sequence[ImageSpan], start: int, n: int) -> list[list[int]]:
    """The three rotary positions (t, h, w axes) of sequence indices start .. start+n-1."""
    axes: list[list[int]] = [[], [], []]
    shift, k = 0, 0
    for p in range(start, start + n):
        while k < len(spans) and spans[k].offset + spans[k].length <= p:
            s = spans[k]
            shift += max(s.grid[1], s.grid[2]) - s.length
            k += 1
        if k < len(spans) and spans[k].offset <= p:
            s = spans[k]
            j, base = p - s.offset, s.offset + shift
            _, gh, gw = s.grid
            axes[0].append(base + j // (gh * gw))
            axes[1].append(base + (j // gw) % gh)
            axes[2].append(base + j % gw)
        else:
            for axis in axes:
                axis.append(p + shift)
    return axes


def section_axes(section: Sequence[int], half: int, interleaved: bool = False) -> torch.Tensor:
    """[half] long: the axis (0 t, 1 h, 2 w) whose position drives each frequency.
    Qwen2.5-VL gives each axis a contiguous run of frequencies (``section`` long each);
    Qwen3-VL (``interleaved``) cycles t, h, w from the first frequency on, h and w
    for their first ``section[1]`` and ``section[2]`` turns, t for the rest."""
    if sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} does not sum to head_dim / 2 = {half}")
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def token_table(rope: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """[T, D] cos|sin rows, one per token: frequency f of token i at its axes[f] position
    (``rope``: [max_positions, D] cos then sin; ``positions``: [3, T])."""
    half = rope.shape[1] // 2
    cols = torch.arange(half, device=rope.device)
    rows = positions.index_select(0, axes.to(positions.device)).t()  # [T, half]
    return torch.cat([rope[rows, cols], rope[rows, cols + half]], dim=1)
