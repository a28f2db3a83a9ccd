"""Mixture-of-experts decode at batch 1 against the memory-bandwidth floor of the weights
a token reads, and against the same model reading every expert.

    python bench/moe_decode.py              # one thread, ~3 minutes
    python bench/moe_decode.py --threads 2
    python bench/moe_decode.py --quantization int8   # also the top-8 model, quantized

A random-weight Qwen3-MoE in fp32 (hidden 1024, 4 layers, 16 query / 4 KV heads of 64,
64 experts of intermediate 512, 8 a token, vocabulary 32,000, untied head: 0.48 B
parameters, of which a token reads 94 M), built once under /tmp. Decode rate: greedy, one 16-token prompt, the
time of 129 tokens minus the time of 1, best of 3, interleaved with the "every expert"
variant (the same weights with ``num_experts_per_tok`` = 64, so every expert runs every
token). The floor: the bytes a token must read (everything but the unchosen experts: 8 of
64 per layer) at the read rate of one large fp32 GEMV through the backend's own kernel.
``--quantization``: the top-8 model with its layers and experts quantized, interleaved too,
against the fp32 one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services import LLM, SamplingParams  # noqa: E402

CACHE = Path("/tmp/epd-bench-moe")
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    max_position_embeddings=4096,  # room for bench/vs_vllm.py --model's warm-up
    tie_word_embeddings=False,
)


def checkpoint() -> tuple[Path, Path]:
    """(the model, the same weights with every expert chosen)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    top, every = CACHE / "top8", CACHE / "all"
    if not (top / "config.json").exists():
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).save_pretrained(str(top))
        vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(top))
    if not (every / "config.json").exists():
        shutil.copytree(top, every)
        cfg = json.loads((every / "config.json").read_text())
        cfg["num_experts_per_tok"] = SHAPE["num_experts"]
        (every / "config.json").write_text(json.dumps(cfg))
    return top, every


def active_bytes(llm: LLM) -> int:
    """Bytes a decode token reads: every weight but the unchosen experts'."""
    total = experts = 0
    for name, p in llm.engine.loaded.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if name.endswith((".gate_up", ".down")):
            experts += nbytes
    if llm.engine.loaded.model.config.tie_word_embeddings:
        raise ValueError("the benchmark model has an untied head")
    embed = SHAPE["hidden_size"] * 4  # one embedding row, not the whole table
    table = SHAPE["vocab_size"] * SHAPE["hidden_size"] * 4
    share = SHAPE["num_experts_per_tok"] / SHAPE["num_experts"]
    return int(total - table + embed - experts * (1 - share))


def read_rate(llm: LLM) -> float:
    """Bytes/s one GEMV row reads a 512 MiB fp32 matrix at, through the engine's backend
    (column-major, as the engine keeps its weights)."""
    backend = llm.engine.backend
    w = torch.randn(4096, 32768).t()
    x = torch.randn(1, 4096)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        backend.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return w.numel() * 4 / best


def decode_rate(llm: LLM, prompt: list[int]) -> float:
    def run(n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(8)  # warm-up
    return 128 / (run(129) - run(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", choices=("int8", "int4"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    top, every = checkpoint()
    llms = {
        "top-8 of 64": LLM(str(top), num_kv_blocks=64),
        "every expert": LLM(str(every), num_kv_blocks=64),
    }
    quantized = f"top-8, {args.quantization}"
    if args.quantization:
        llms[quantized] = LLM(str(top), num_kv_blocks=64, quantization=args.quantization)
    prompt = list(range(100, 116))
    rates: dict[str, float] = {k: 0.0 for k in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            rates[name] = max(rates[name], decode_rate(llm, prompt))
    bytes_per_token = active_bytes(llms["top-8 of 64"])
    rate = read_rate(llms["top-8 of 64"])
    floor = rate / bytes_per_token
    print(
        f"Qwen3-MoE fp32, {args.threads} thread(s): {bytes_per_token / 1e6:.0f} MB read a "
        f"token; GEMV read rate {rate / 1e9:.1f} GB/s -> floor {floor:.1f} tok/s"
    )
    for name, r in rates.items():
        print(f"{name:<14} {r:7.1f} tok/s  {r / floor:6.1%} of the top-8 floor")
    print(f"top-8 against every expert: {rates['top-8 of 64'] / rates['every expert']:.2f}x")
    if args.quantization:
        print(f"{quantized} against fp32: {rates[quantized] / rates['top-8 of 64']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
