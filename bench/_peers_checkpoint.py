"""Checkpoints every system in ``serving_peers.py`` serves, built once into a cache dir.

- ``text``: the shared checkpoint of ``docs/serving-peers.md``: a random-weight Llama in fp32
  (hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32,000) with an offline WordLevel fast
  tokenizer (``<unk> <s> </s> w3 ... w31999``) and a trivial chat template. Prompts go as
  token ids, so no system's tokenizer changes what the model sees.
- ``text-words``: the same weights and config with the demo model's WordPiece tokenizer
  (30,523 ids, all below 32,000), for workloads sent as text: the WordLevel vocabulary
  reads every English word as ``<unk>``, so different questions would be the same ids.
- ``gguf``: the same weights as an f32 GGUF for llama.cpp, written by llama.cpp's own
  converter (run in a peer venv: ``_peers_gguf.py``) from a SentencePiece model with the
  same 32,000 pieces.
- ``vlm``: the demo model's LLaVA with a CLIP ViT-B/16-sized vision tower (768 wide, 12
  layers, 224 px, 16 px patches: 196 image tokens), config only: served with
  ``--load-format dummy``, so no weights are written or read.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

VOCAB = 32000
SPECIALS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXT_NAME = "peers-llama"
VLM_NAME = "peers-llava-vitb16"


def piece(i: int) -> str:
    """The vocabulary entry of id ``i`` (the same in the WordLevel and SentencePiece vocab)."""
    return SPECIALS[i] if i < len(SPECIALS) else f"w{i}"


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {piece(i): i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_fast_tokenizer(backend, out)


def save_fast_tokenizer(backend, out: Path) -> None:
    """``backend`` (a ``tokenizers.Tokenizer``) saved as the peers' tokenizer: their
    special tokens and trivial chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))


def text_checkpoint(cache: Path) -> Path:
    """The shared Llama checkpoint (peers.md), built once under ``cache``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = cache / TEXT_NAME
    if (out / "model.safetensors").exists():
        return out
    cfg = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    _save_tokenizer(tmp)
    model.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def text_words_checkpoint(cache: Path) -> Path:
    """``text_checkpoint``'s weights (linked, not copied) with the demo's tokenizer."""
    import shutil

    demo = demo_dir()

    def tokenizer(folder: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(demo / name, folder / name)

    return with_tokenizer(cache, f"{TEXT_NAME}-words", tokenizer)


def with_tokenizer(cache: Path, name: str, write_tokenizer) -> Path:
    """``text_checkpoint``'s weights (linked, not copied) in ``cache / name``, with the
    tokenizer ``write_tokenizer(folder)`` writes there; built once."""
    import shutil

    text, out = text_checkpoint(cache), cache / name
    if (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for weights in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp / weights).symlink_to(text / weights)
    write_tokenizer(tmp)
    tmp.rename(out)
    return out


def gguf_file(cache: Path, text_dir: Path, python: Path, converter: Path) -> Path:
    """The f32 GGUF of ``text_dir``, converted once with ``python`` (a venv holding torch
    and sentencepiece) running ``_peers_gguf.py`` and llama.cpp's ``converter``."""
    out = cache / f"{TEXT_NAME}-f32.gguf"
    if not out.exists():
        script = Path(__file__).with_name("_peers_gguf.py")
        subprocess.run(
            [str(python), str(script), str(text_dir), str(out), str(converter)], check=True
        )
    return out


def demo_dir() -> Path:
    """The built-in demo checkpoint (generated once, where ``epd`` keeps it)."""
    from services.config import EngineConfig
    from services.models.demo import ensure_demo_model

    return ensure_demo_model(EngineConfig().demo_dir)


def vlm_checkpoint(cache: Path) -> Path:
    """The demo LLaVA with a ViT-B/16-sized CLIP tower: config + tokenizer + processor."""
    from transformers import AutoConfig, CLIPImageProcessor

    out = cache / VLM_NAME
    if (out / "config.json").exists():
        return out
    demo = demo_dir()
    cfg = AutoConfig.from_pretrained(str(demo))
    vision = cfg.vision_config
    # CLIP ViT-B/16's shape (the text decoder stays the demo's).
    vision.hidden_size, vision.intermediate_size = 768, 3072
    vision.num_hidden_layers, vision.num_attention_heads = 12, 12
    vision.image_size, vision.patch_size = 224, 16
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(tmp))
    for name in demo.iterdir():
        if name.name.startswith(("tokenizer", "chat_template", "generation_config")):
            (tmp / name.name).write_bytes(name.read_bytes())
    CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).save_pretrained(str(tmp))
    tmp.rename(out)
    return out
