"""transformers as the reference: greedy tokens and raw logprobs, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(path: Path):
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = "vision_config" in json.loads((path / "config.json").read_text())
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, input_ids: list[int], max_new_tokens: int, pixel_values=None, **mm):
    """-> (generated ids, top-5 raw logprobs per step as [(id, logprob)]); ``mm``: the
    model's other image inputs (Qwen's image_grid_thw, mm_token_type_ids)."""
    kwargs = {"pixel_values": pixel_values, **mm} if pixel_values is not None else {}
    out = model.generate(
        torch.tensor([input_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
        **kwargs,
    )
    ids = out.sequences[0, len(input_ids) :].tolist()
    top = []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].float(), dim=-1)
        vals, idx = lp.topk(5)
        top.append(list(zip(idx.tolist(), vals.tolist(), strict=True)))
    return ids, top


def gemma3_reference(ckpt: Path, hf, messages: list[dict], max_new_tokens: int):
    """(prompt ids, transformers' greedy ids and top-5) for a Gemma 3 chat whose image
    parts hold PIL images: the template rendered, each <start_of_image> replaced by the
    processor's full image sequence (its rule, written out here), then tokenized."""
    from transformers import AutoImageProcessor, AutoTokenizer

    boi, eoi, image = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    plain, images = [], []
    for m in messages:
        if isinstance(m["content"], str):
            plain.append(m)
            continue
        parts = [{"type": p["type"], "text": p.get("text")} for p in m["content"]]
        plain.append({**m, "content": parts})
        images += [p["image"] for p in m["content"] if p["type"] == "image"]
    text = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    text = text.replace(boi, f"\n\n{boi}{image * hf.config.mm_tokens_per_image}{eoi}\n\n")
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, hf_greedy(hf, ids, max_new_tokens)
    proc = AutoImageProcessor.from_pretrained(str(ckpt), backend="pil")
    pixels = proc(images=images, return_tensors="pt")["pixel_values"]
    types = (torch.tensor([ids]) == hf.config.image_token_index).int()
    return ids, hf_greedy(hf, ids, max_new_tokens, pixel_values=pixels, token_type_ids=types)


def check_greedy(out, ref, tol: float = 1e-3) -> None:
    """An engine output against ``hf_greedy``'s (ids, top-5): the same tokens, and each
    of transformers' top-5 logprobs within ``tol`` of ours."""
    ids, top = ref
    comp = out.outputs[0]
    assert comp.token_ids == ids
    for ours, theirs in zip(comp.logprobs, top, strict=False):
        for tid, lp in theirs:
            assert abs(ours[tid].logprob - lp) < tol


def _quantized_kv_attention(fmt: str):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from services.kernels import kv_quant

    def through(x):
        return kv_quant.dequantize(kv_quant.quantize(x, fmt), x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, through(key), through(value), *args, **kwargs)

    return attention


def read_kv_quantized(model, fmt: str = "int8"):
    """``model`` (transformers) made to attend to every key and value through a quantized
    KV cache's rounding (``fmt`` codes and a scale per token and KV head, dequantized): the
    arithmetic of ``--kv-cache-dtype fmt``, in full precision otherwise."""
    from transformers import AttentionInterface

    AttentionInterface.register(f"epd_{fmt}_kv", _quantized_kv_attention(fmt))
    model.config._attn_implementation = f"epd_{fmt}_kv"
    return model
