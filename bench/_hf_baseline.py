"""The transformers baselines of bench/engine_throughput.py: ``generate`` on left-padded
batches, in batches of a fixed size, or one prompt at a time."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model


@torch.inference_mode()
def hf_padded(model, prompts, max_new: int) -> tuple[float, list[list[int]]]:
    """Left-padded batch through ``generate``: (seconds, new ids per prompt)."""
    pad = model.config.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad,
    )
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + max_new, "transformers stopped early"
    return dt, out[:, width:].tolist()


def hf_batches(model, prompts, out_lens, batch: int) -> float:
    """Padded batches in arrival order, each run to its longest output; total seconds."""
    total = 0.0
    for i in range(0, len(prompts), batch):
        total += hf_padded(model, prompts[i : i + batch], max(out_lens[i : i + batch]))[0]
    return total


def hf_sequential(model, prompts, new: int) -> tuple[float, list[list[int]]]:
    total, ids = 0.0, []
    for p in prompts:
        dt, out = hf_padded(model, [p], new)
        total += dt
        ids.append(out[0])
    return total, ids
