"""Tiny random checkpoints written with transformers' save_pretrained (fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from services.models.demo import _build_tokenizer

TEXT_ARCHS = ("llama", "qwen2", "qwen3", "mistral")  # the Llama family
GEMMA_ARCHS = ("gemma3",)
MOE_ARCHS = ("qwen3_moe", "mixtral")
# Mamba-2, attention, dense and mixture-of-experts layers in one stack (Nemotron-H).
NEMOTRON_H_LAYERS = [
    "linear_attention",
    "moe",
    "full_attention",
    "linear_attention",
    "mlp",
    "linear_attention",
    "moe",
]


def _text_config(kind: str, vocab: int, tok, **over):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        NemotronHConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma3": Gemma3TextConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "nemotron_h": NemotronHConfig,
    }[kind]
    kw = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=kind == "qwen3",
        head_dim=16,
    )
    if kind == "mistral":
        kw["sliding_window"] = None
    if kind == "gemma3":
        # Two sliding-window layers (a 16-token window, so test prompts outgrow it) around
        # a global one, each kind with its own rotary base; the head tied, as Gemma's is.
        kw.update(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            final_logit_softcapping=30.0,
        )
    if kind == "qwen3_moe":
        # 8 experts, 2 a token, normalised; the middle of three layers dense.
        kw.update(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "mixtral":
        kw.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
    if kind == "nemotron_h":
        # Chunks of 8 tokens in the Mamba scan (prompts span several); grouped routing
        # over 8 experts through a latent projection, with a shared expert.
        kw.update(
            layers_block_type=list(NEMOTRON_H_LAYERS),
            num_hidden_layers=len(NEMOTRON_H_LAYERS),
            mamba_num_heads=8,
            mamba_head_dim=8,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        )
    kw.update(over)
    return cls(**kw)


def _randomize(model, seed: int, std: float = 0.1) -> None:
    """Larger-than-default random weights: peaky logits, so greedy never sits on a tie."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_text_checkpoint(
    root: Path, kind: str, seed: int = 0, shards: bool = False, **over
) -> Path:
    from transformers import AutoModelForCausalLM

    out = root / f"{kind}-{seed}{'-sharded' if shards else ''}"
    if (out / "config.json").exists():
        return out
    tok = _build_tokenizer(out)
    cfg = _text_config(kind, len(tok), tok, **over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    if kind == "nemotron_h":
        _randomize_mamba(model, seed)
    model.generation_config.eos_token_id = tok.sep_token_id
    model.save_pretrained(str(out), max_shard_size="1MB" if shards else "10GB")
    return out


def _randomize_mamba(model, seed: int) -> None:
    """The vectors _randomize leaves at their init: decay rates, skips, routing biases."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("A_log", ".D")):
                t.copy_(torch.rand(t.shape, generator=gen) * 2 - 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)


def make_llava_checkpoint(
    root: Path,
    vision: str = "clip",
    text: str = "llama",
    seed: int = 0,
    strategy: str = "default",
    feature_layer=-2,
    image_size: int = 32,
    patch_size: int = 8,
    nested_processor: bool = False,
    **text_over,
) -> Path:
    """``nested_processor``: save the image processor as transformers 5's
    ``LlavaProcessor.save_pretrained`` does (only processor_config.json)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    out = root / f"llava-{vision}-{text}-{strategy}-{seed}"
    if (image_size, patch_size, text_over, nested_processor) != (32, 8, {}, False):
        out = out.with_name(
            f"{out.name}-{image_size}-{patch_size}-{len(text_over)}-{int(nested_processor)}"
        )
    if (out / "config.json").exists():
        return out
    tok = _build_tokenizer(out)
    vcls = CLIPVisionConfig if vision == "clip" else SiglipVisionConfig
    vcfg = vcls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    tcfg = _text_config(text, len(tok), tok, **text_over)
    cfg = LlavaConfig(
        vision_config=vcfg,
        text_config=tcfg,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    _randomize(model, seed)
    model.generation_config.eos_token_id = tok.sep_token_id
    model.save_pretrained(str(out))
    proc = CLIPImageProcessor if vision == "clip" else SiglipImageProcessor
    side = {"height": image_size, "width": image_size}
    kw = (
        {"size": {"shortest_edge": image_size}, "crop_size": side}
        if vision == "clip"
        else {"size": side}
    )
    if nested_processor:
        from transformers import LlavaProcessor

        LlavaProcessor(
            image_processor=proc(**kw),
            tokenizer=tok,
            patch_size=patch_size,
            vision_feature_select_strategy=strategy,
            chat_template=tok.chat_template,
        ).save_pretrained(str(out))
        assert not (out / "preprocessor_config.json").exists()
    else:
        proc(**kw).save_pretrained(str(out))
    return out


QWEN_VL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"]
QWEN_VL_SPECIALS += ["<|vision_end|>", "<|video_pad|>"]


def _tokenizer_with(out: Path, specials: list[str], template: str):
    """The test tokenizer with a model family's special tokens and chat template, saved
    into ``out``; (tokenizer, special token -> id)."""
    tok = _build_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return tok, {t: tok.convert_tokens_to_ids(t) for t in specials}


TINY_QWEN_VISION = {
    "qwen2_5_vl": dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        window_size=56,
        fullatt_block_indexes=[1],
    ),
    # Learned positions on a 4x4 grid (resampled to each image); DeepStack features
    # from both blocks, added after the decoder's first two layers (of three).
    "qwen3_vl": dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    ),
}
_QWEN_PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}


def make_qwen2_5_vl_checkpoint(
    root: Path,
    seed: int = 0,
    min_pixels: int = 28 * 28 * 2,
    max_pixels: int = 28 * 28 * 24,
    vision: dict | None = None,
) -> Path:
    """A tiny Qwen2.5-VL: a 2-block windowed ViT (one full-attention block), a Qwen2
    decoder with M-RoPE, the PIL image processor with a small pixel budget (images of a
    few dozen pixels take 2..24 tokens) and a Qwen-VL-shaped chat template. ``vision``:
    the tower's shape instead of the tiny one (benchmarks give it real widths)."""
    return _make_qwen_vl(root, "qwen2_5_vl", seed, min_pixels, max_pixels, vision)


def make_qwen3_vl_checkpoint(root: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-VL: a 2-block ViT with 16-pixel patches and DeepStack features from
    both blocks, a 3-layer Qwen3 decoder with interleaved M-RoPE, the same small pixel
    budget in tokens (2..24) and chat template as the Qwen2.5-VL one."""
    return _make_qwen_vl(root, "qwen3_vl", seed, 32 * 32 * 2, 32 * 32 * 24, None)


def _make_qwen_vl(root, kind, seed, min_pixels, max_pixels, vision) -> Path:
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tests.helpers.chat_templates import QWEN_VL

    vision = vision or TINY_QWEN_VISION[kind]
    shape = "-".join(str(vision[k]) for k in ("depth", "hidden_size"))
    out = root / f"{kind}-{seed}-{min_pixels}-{max_pixels}-{shape}"
    if (out / "config.json").exists():
        return out
    tok, ids = _tokenizer_with(out, QWEN_VL_SPECIALS, QWEN_VL)
    decoder = "qwen2" if kind == "qwen2_5_vl" else "qwen3"
    layers = 2 if kind == "qwen2_5_vl" else 3
    text = _text_config(decoder, len(tok), tok, num_hidden_layers=layers).to_dict()
    text["tie_word_embeddings"] = False
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"]["mrope_section"] = [2, 3, 3]  # head_dim 16: 8 frequencies
    if kind == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
    patch = _QWEN_PATCH[kind]
    cfg = AutoConfig.for_model(
        kind,
        text_config=text,
        vision_config=dict(
            out_hidden_size=text["hidden_size"],
            patch_size=patch,
            spatial_merge_size=2,
            temporal_patch_size=2,
            **vision,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg)
    _randomize(model, seed)
    model.generation_config.eos_token_id = tok.sep_token_id
    model.save_pretrained(str(out))
    proc = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch, merge_size=2
    )
    proc.save_pretrained(str(out))
    return out


GEMMA3_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"]
GEMMA3_SPECIALS += ["<image_soft_token>"]


def make_gemma3_checkpoint(root: Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 with images: a 2-layer SigLIP tower on 32-pixel images (16
    patches, pooled to 4 image tokens), the 3-layer Gemma 3 decoder of
    ``make_text_checkpoint(root, "gemma3")`` (a 16-token sliding window), Gemma's
    processor and a Gemma-shaped chat template."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    from tests.helpers.chat_templates import GEMMA3

    out = root / f"gemma3-vl-{seed}"
    if (out / "config.json").exists():
        return out
    tok, ids = _tokenizer_with(out, GEMMA3_SPECIALS, GEMMA3)
    cfg = Gemma3Config(
        # No final soft-capping, as in Gemma 3's own checkpoints (transformers' Gemma 3 with
        # images would ignore it; its text-only model applies it, and so do we).
        text_config=_text_config("gemma3", len(tok), tok, final_logit_softcapping=None).to_dict(),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    _randomize(model, seed)
    model.generation_config.eos_token_id = tok.sep_token_id
    model.save_pretrained(str(out))
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(str(out))
    return out


def random_image(seed: int, size=(40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr)


def make_byte_bpe_checkpoint(
    root: Path, kind: str = "qwen2", seed: int = 0, chat_template: str | None = None
) -> Path:
    """A tiny checkpoint whose tokenizer is byte-level BPE (the Qwen / Llama 3 kind),
    trained here on a few lines; every byte is a token, so any text can be written.
    ``chat_template``: saved with the tokenizer (tests/helpers/chat_templates.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    name = f"{kind}-bytebpe-{seed}" + ("-chat" if chat_template else "")
    out = root / name
    if (out / "config.json").exists():
        return out
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = ['{"name": "value", "count": 12, "ok": true}', "the quick brown fox 0123456789"]
    bpe.train_from_iterator(lines * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.chat_template = chat_template
    return _save_tokenizer_and_model(out, tok, kind, seed, 2048 if chat_template else 512)


def make_sentencepiece_checkpoint(root: Path, seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer is SentencePiece-style BPE (the Llama 2 / Mistral
    kind, as transformers converts it): ``▁`` for spaces, and byte fallback, so any text
    can be written (a piece for each of the 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = root / f"llama-sentencepiece-{seed}"
    if (out / "config.json").exists():
        return out
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learn = Tokenizer(models.BPE(unk_token="<unk>"))
    learn.normalizer = norm
    lines = ['{"name": "value", "count": 12, "ok": true}', "the quick brown fox 0123456789"]
    specials = ["<unk>", "<s>", "</s>"]
    learn.train_from_iterator(
        lines * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    )
    learned = json.loads(learn.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    sp = Tokenizer(model)
    sp.normalizer = norm
    sp.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    sp.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return _save_tokenizer_and_model(out, tok, "llama", seed, 512)


def _save_tokenizer_and_model(out: Path, tok, kind: str, seed: int, positions: int) -> Path:
    """Save ``tok`` and a random-weight model of ``kind`` sized to it (EOS: its own)."""
    from transformers import AutoModelForCausalLM

    tok.save_pretrained(str(out))
    eos = tok.eos_token_id
    cfg = _text_config(
        kind,
        len(tok),
        tok,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        max_position_embeddings=positions,  # a chat prompt with tools in it is long
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(out))
    return out
