"""Architecture registry: the checkpoint's ``architectures`` name picks the model class."""

from __future__ import annotations

from torch import nn

from services.models.config_json import UnsupportedModelError
from services.models.gemma3 import Gemma3ForCausalLM
from services.models.gemma3_vl import Gemma3ForConditionalGeneration
from services.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from services.models.llava import LlavaForConditionalGeneration
from services.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from services.models.nemotron_h import NemotronHForCausalLM
from services.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from services.models.qwen3_vl import Qwen3VLForConditionalGeneration

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
}


def resolve(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in MODELS:
            return MODELS[arch]
    raise UnsupportedModelError(
        f"unsupported architecture {architectures!r}; supported: {sorted(MODELS)}"
    )


def is_multimodal(model: nn.Module) -> bool:
    return hasattr(model, "encode_images")
