"""``quantization="int8" | "int4"``: the engine with quantized linears against transformers
running the same checkpoint with each of those weights replaced by its dequantized codes
(the arithmetic the kernels do, in full precision): greedy tokens identical, logprobs close.

Prompts of several lengths in one batch (multi-row products), a token budget that chunks
the prefills, and a repeated prompt (prefix caching) all go through the quantized layers.
"""

import pytest
import torch
from torch import nn

from services.llm import LLM
from services.models.checkpoint import CheckpointError
from services.models.moe import ExpertDispatch
from services.models.quantize import QuantLinear
from services.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_text_checkpoint
from tests.helpers.quantized_checkpoints import write_awq, write_compressed, write_gptq
from tests.helpers.reference import check_greedy, hf_greedy, load_hf

pytestmark = pytest.mark.slow

MAX_NEW = 10
PROMPTS = [[5 + (i * 37 + j * 11) % 900 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]


def _dequantized_hf(ckpt, method: str):
    """transformers' model of ckpt, its linears (not the head, not a router) and each
    expert's matrices ([E, out, in] stacks) replaced by their quantized-then-dequantized
    weights."""
    from services.kernels.quant import quantize

    hf = load_hf(ckpt)
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] not in ("lm_head", "gate"):
                mod.weight.copy_(quantize(mod.weight, method).dequantize())
        for name, p in hf.named_parameters():
            if ".experts." in name and p.dim() == 3:
                for e in range(p.shape[0]):
                    p[e].copy_(quantize(p[e], method).dequantize())
    return hf


CASES = [
    ("llama", "int8", "cpu"),
    ("llama", "int4", "cpu"),
    ("llama", "int4", "torch"),
    ("nemotron_h", "int8", "cpu"),
    ("nemotron_h", "int4", "cpu"),
    ("qwen3_moe", "int8", "cpu"),
    ("mixtral", "int4", "cpu"),
    ("qwen3_moe", "int4", "torch"),
]


@pytest.mark.parametrize("kind,method,backend", CASES)
def test_greedy_matches_transformers_on_dequantized_weights(
    tmp_path_factory, kind, method, backend
):
    ckpt = make_text_checkpoint(tmp_path_factory.getbasetemp() / "quant", kind)
    hf = _dequantized_hf(ckpt, method)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(
        str(ckpt),
        quantization=method,
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
    )
    model = llm.engine.loaded.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.method == method for m in quantized)
    moes = [m for m in model.modules() if isinstance(m, ExpertDispatch)]
    assert all(m.quantized is not None for m in moes) and (moes or kind == "llama")
    assert not isinstance(getattr(model, "lm_head", None), QuantLinear)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    for _ in range(2):  # the second time the llama prompts come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for out, ref in zip(outs, refs, strict=True):
            check_greedy(out, ref, tol=2e-3)


def test_unknown_method_is_a_clear_error(llama_ckpt):
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(llama_ckpt), quantization="fp4")


WRITERS = {
    "compressed-int8": lambda src, out: write_compressed(src, out, 8),
    "compressed-int4": lambda src, out: write_compressed(src, out, 4),
    "gptq": write_gptq,
    "awq": write_awq,
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_published_quantized_checkpoint_loads_its_own_codes(tmp_path_factory, fmt):
    root = tmp_path_factory.getbasetemp() / "quant"
    src = make_text_checkpoint(root, "llama")
    ckpt, twin = WRITERS[fmt](src, root / f"llama-{fmt}")
    refs = [hf_greedy(load_hf(twin), p, MAX_NEW) for p in PROMPTS]
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256)
    layers = llm.engine.loaded.model.model.layers
    qkv = layers[0].self_attn.qkv_proj
    bits = 8 if fmt == "compressed-int8" else 4
    assert isinstance(qkv, QuantLinear) and qkv.method == f"int{bits}"
    if bits == 4:
        assert qkv.group == 32  # the checkpoint's groups, not ours
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, ref in zip(outs, refs, strict=True):
        check_greedy(out, ref, tol=2e-3)
    with pytest.raises(ValueError, match="quantized already"):
        LLM(str(ckpt), quantization="int8")


def test_gptq_act_order_groups_are_a_clear_error(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.getbasetemp() / "quant"
    src = make_text_checkpoint(root, "llama")
    ckpt, _ = write_gptq(src, root / "llama-gptq-actorder")
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    name = next(n for n in tensors if n.endswith("q_proj.g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match="act-order"):
        LLM(str(ckpt))


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized"},
            "format 'float-quantized'",
        ),
    ],
)
def test_quantization_we_cannot_run_is_a_clear_error(tmp_path, llama_ckpt, qc, match):
    import json
    import shutil

    ckpt = tmp_path / "q"
    shutil.copytree(llama_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    with pytest.raises(CheckpointError, match=match):
        LLM(str(ckpt))
