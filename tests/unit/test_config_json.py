"""The torch-free config reader agrees with transformers' AutoConfig: the defaults it
lists are the config classes' own, and every fact it reads (context, window, vocabulary,
EOS, image token, image tokens) is what AutoConfig gives, for full configs as
transformers 5 saves them and for minimal ones that leave defaults out."""

from __future__ import annotations

import json

import pytest

from services.models import config_json
from services.models.config_json import read_facts
from tests.helpers.checkpoints import (
    make_gemma3_checkpoint,
    make_llava_checkpoint,
    make_qwen2_5_vl_checkpoint,
    make_qwen3_vl_checkpoint,
    make_text_checkpoint,
)


def _autoconfig_facts(path):
    from transformers import AutoConfig

    from services.models.llava import image_token_id, tokens_per_image

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    text = getattr(cfg, "text_config", None) or cfg
    window = getattr(text, "sliding_window", None)
    if not getattr(text, "use_sliding_window", True):
        window = None
    if text.model_type in config_json._OWN_WINDOWS:  # its layers apply the window
        window = None
    vision = getattr(cfg, "vision_config", None) is not None
    dynamic = cfg.model_type in config_json.QWEN_VL_TEXT_TYPES  # tokens follow the image
    per_image = 0
    if cfg.model_type == "gemma3":
        per_image = cfg.mm_tokens_per_image
    elif vision and not dynamic:
        per_image = tokens_per_image(cfg)
    return (
        text.max_position_embeddings,
        window,
        text.vocab_size,
        getattr(text, "eos_token_id", None),  # Qwen3-VL's text config has none
        image_token_id(cfg) if vision else None,
        per_image,
    )


def _ours(path):
    f = read_facts(json.loads((path / "config.json").read_text()))
    return (
        f.max_position_embeddings,
        f.sliding_window,
        f.vocab_size,
        f.eos_token_id,
        f.image_token_id,
        f.tokens_per_image,
    )


def test_default_tables_are_transformers_defaults():
    from transformers import (
        CLIPVisionConfig,
        Gemma3Config,
        Gemma3TextConfig,
        LlamaConfig,
        LlavaConfig,
        MistralConfig,
        MixtralConfig,
        NemotronHConfig,
        Qwen2_5_VLConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        SiglipVisionConfig,
    )
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig, Qwen3VLTextConfig

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "clip_vision_model": CLIPVisionConfig,
        "siglip_vision_model": SiglipVisionConfig,
        "qwen2_5_vl_text": Qwen2_5_VLTextConfig,
        "qwen3_vl_text": Qwen3VLTextConfig,
        "gemma3_text": Gemma3TextConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "nemotron_h": NemotronHConfig,
    }
    for table in (config_json._TEXT_DEFAULTS, config_json._VISION_DEFAULTS):
        for kind, defaults in table.items():
            made = classes[kind]()
            assert {k: getattr(made, k) for k in defaults} == defaults, kind
    llava = LlavaConfig()
    assert llava.image_token_index == config_json._LLAVA_DEFAULTS["image_token_index"]
    assert llava.vision_feature_select_strategy == "default"
    assert llava.text_config.model_type == config_json._LLAVA_SUB_TYPES["text_config"]
    assert llava.vision_config.model_type == config_json._LLAVA_SUB_TYPES["vision_config"]
    gemma = Gemma3Config()
    assert {k: getattr(gemma, k) for k in config_json._GEMMA3_DEFAULTS} == (
        config_json._GEMMA3_DEFAULTS
    )
    for qwen_vl in (Qwen2_5_VLConfig(), Qwen3VLConfig()):
        assert qwen_vl.image_token_id == config_json._QWEN_VL_DEFAULTS["image_token_id"]


@pytest.mark.parametrize(
    "make",
    [
        lambda r: make_text_checkpoint(r, "llama"),
        lambda r: make_text_checkpoint(r, "qwen2"),
        lambda r: make_text_checkpoint(r, "qwen3"),
        lambda r: make_text_checkpoint(r, "mistral"),
        lambda r: make_text_checkpoint(r, "gemma3"),
        lambda r: make_text_checkpoint(r, "qwen3_moe"),
        lambda r: make_text_checkpoint(r, "mixtral"),
        lambda r: make_llava_checkpoint(r),
        lambda r: make_llava_checkpoint(r, vision="siglip"),
        lambda r: make_llava_checkpoint(r, strategy="full"),
        lambda r: make_qwen2_5_vl_checkpoint(r),
        lambda r: make_qwen3_vl_checkpoint(r),
        lambda r: make_gemma3_checkpoint(r),
    ],
    ids=[
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma3",
        "qwen3_moe",
        "mixtral",
        "llava-clip",
        "llava-siglip",
        "llava-full",
        "qwen2_5_vl",
        "qwen3_vl",
        "gemma3-vl",
    ],
)
def test_saved_checkpoints_read_as_autoconfig_reads_them(tmp_path, make):
    path = make(tmp_path)
    assert _ours(path) == _autoconfig_facts(path)


MINIMAL = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    "qwen2-window": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 4096,
    },
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
    "gemma3-vl": {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {},
        "vision_config": {},
    },
    "llava": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {"vocab_size": 32064},
        "vision_config": {"image_size": 336, "patch_size": 14},
    },
    "llava-siglip": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_id": 7,
        "vision_feature_select_strategy": "full",
        "text_config": {"model_type": "qwen2"},
        "vision_config": {"model_type": "siglip_vision_model"},
    },
    "qwen2_5_vl": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vision_config": {},
    },
    # Written before transformers 5: the decoder's fields on top.
    "qwen2_5_vl-flat": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": 151936,
        "max_position_embeddings": 128000,
        "eos_token_id": 151645,
        "image_token_id": 151655,
        "vision_config": {},
    },
    "qwen3_vl": {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": {"vocab_size": 151936},
        "vision_config": {},
    },
}


@pytest.mark.parametrize("name", list(MINIMAL))
def test_minimal_configs_take_the_class_defaults(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL[name]))
    assert _ours(tmp_path) == _autoconfig_facts(tmp_path)


def test_supported_names_are_the_registry(tmp_path):
    from services.models.checkpoint import CheckpointError
    from services.models.registry import MODELS

    assert set(MODELS) == config_json.SUPPORTED_ARCHITECTURES
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        read_facts({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
