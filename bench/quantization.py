"""Quantized weights (``--quantization int8|int4``) and the int8 KV cache
(``--kv-cache-dtype int8|fp8``) against fp32: quality, speed, memory.

    python bench/quantization.py [--threads 1] [--rounds 2] [--json out.json]
    python bench/quantization.py --model shared      # speed and memory of a 56 M Llama

On the trained code model of bench/spec_decode.py (built and cached on first use, ~5
CPU-minutes; ~11 M parameters, weight-bound at batch 1), six configurations: fp32,
int8 and int4 weights, fp32 weights with the int8 or the fp8 KV cache, int8 weights with
the int8 one:

1. quality: perplexity on held-out stdlib text of the model with each linear replaced by
   its dequantized codes and, with the int8 KV cache, every key and value read through
   its quantization (transformers runs it: the arithmetic our kernels do, see
   tests/unit/test_quantized_models.py and test_kv_quant_models.py), and the engine's
   greedy continuations of held-out prompts against fp32's (identical continuations;
   tokens before the first difference);
2. speed: the engine (``LLM``) at batch 1 (decode tokens/s) and with 64 prompts at once
   (generated tokens/s), every format timed in turn within each round (ratios from
   interleaved runs; the best round of each);
3. memory: bytes of the model's weights and of one token's KV, and the resident memory
   of a fresh process that loads the engine, per configuration.
Prints a JSON report (``--json``: also written to a file). ``--model shared`` (or a
checkpoint directory) measures speed and memory only, on that checkpoint: the shared
56 M-parameter Llama of docs/serving-peers.md (random weights) is weight-bound from
memory where the 11 M code model's int8 codes fit in a large L3, and its fp32 LM head
(32,000 x 512, kept in full precision as vLLM keeps it) is most of what int4 reads.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spec_train import Recipe, build_target, held_out_loss  # noqa: E402
from spec_decode import held_out_prompts  # noqa: E402

from services.kernels.quant import quantize  # noqa: E402
from services.llm import LLM  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.reference import read_kv_quantized  # noqa: E402

# name -> (weights, KV cache dtype)
CONFIGS = {
    "fp32": (None, "auto"),
    "int8": ("int8", "auto"),
    "int4": ("int4", "auto"),
    "kv-int8": (None, "int8"),
    "kv-fp8": (None, "fp8"),
    "int8+kv-int8": ("int8", "int8"),
}
GOALS = {
    "ppl_int8": 1.01,
    "ppl_int4": 1.05,
    "ppl_kv-int8": 1.01,
    "ppl_kv-fp8": 1.01,
    "b1_int8": 1.8,
    "b1_int4": 2.5,
    "w64_int8": 1.0,
}


def perplexity(target: Path, weights: str | None, kv: str) -> float:
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    if weights:
        with torch.no_grad():
            for mod_name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and not mod_name.endswith("lm_head"):
                    mod.weight.copy_(quantize(mod.weight, weights).dequantize())
    if kv != "auto":
        read_kv_quantized(model, kv)
    with torch.inference_mode():
        loss = held_out_loss(Recipe(), model, AutoTokenizer.from_pretrained(str(target)))
    return math.exp(loss)


def agreement(ours: list[list[int]], fp32: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ours, fp32, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        prefix.append(same / len(b))
    return {
        "identical": sum(a == b for a, b in zip(ours, fp32, strict=True)) / len(fp32),
        "tokens_before_first_difference": sum(prefix) / len(prefix),
    }


def timed(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t0
    return len(prompts) * new / dt, [o.outputs[0].token_ids for o in outs]


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.loaded.model
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def speed_model(name: str) -> Path:
    if name != "shared":
        return Path(name)
    import _peers_checkpoint

    return _peers_checkpoint.text_checkpoint(Path("/tmp/peers/ckpt"))


def kv_bytes_per_token(llm: LLM) -> int:
    pool = llm.engine.kv
    return pool.data[:, :, 0].numel() * pool.data.element_size() // pool.block_size


def resident_mb(target: Path, weights: str | None, kv: str, threads: int) -> float:
    """VmRSS of a fresh process holding the engine (a 64 MiB KV pool)."""
    root = str(Path(__file__).resolve().parents[1])
    code = "\n".join(
        [
            f"import torch, sys; torch.set_num_threads({threads}); sys.path.insert(0, {root!r})",
            "from services.llm import LLM",
            f"llm = LLM({str(target)!r}, quantization={weights!r}, kv_cache_dtype={kv!r},"
            " kv_cache_memory_mb=64)",
            "rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]",
            "print(int(rss.split()[1]) / 1024)",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--model", help="`shared` or a checkpoint directory: speed and memory only, on it"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        target = speed_model(args.model)
        prompts = [[100 + (i * 37 + j * 11) % 900 for j in range(48)] for i in range(64)]
    else:
        target, _ = build_target()
        from transformers import AutoTokenizer

        prompts = held_out_prompts(AutoTokenizer.from_pretrained(str(target)), 64, 48)
    engines = {
        n: LLM(
            str(target),
            quantization=weights,
            kv_cache_dtype=kv,
            kv_cache_memory_mb=256,
            enable_prefix_caching=False,
        )
        for n, (weights, kv) in CONFIGS.items()
    }
    speed: dict[str, dict[str, float]] = {n: {"b1": 0.0, "w64": 0.0} for n in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for n, llm in engines.items():
            b1, _ = timed(llm, prompts[:1], args.new)
            w64, outs = timed(llm, prompts, args.new)
            speed[n]["b1"] = max(speed[n]["b1"], b1)
            speed[n]["w64"] = max(speed[n]["w64"], w64)
            outputs[n] = outs
    report = {
        "model": str(target),
        "host_threads": args.threads,
        "tokens_per_s": speed,
        "speedup": {n: {k: speed[n][k] / speed["fp32"][k] for k in ("b1", "w64")} for n in engines},
        "greedy_vs_fp32": {n: agreement(outputs[n], outputs["fp32"]) for n in engines},
    }
    if not args.model:
        ppl = {n: perplexity(target, *c) for n, c in CONFIGS.items()}
        report["perplexity"] = ppl
        report["perplexity_ratio"] = {n: ppl[n] / ppl["fp32"] for n in ppl}
    report |= {
        "weight_mb": {n: weight_bytes(llm) / 2**20 for n, llm in engines.items()},
        "kv_bytes_per_token": {n: kv_bytes_per_token(llm) for n, llm in engines.items()},
        "resident_mb": {n: resident_mb(target, *c, args.threads) for n, c in CONFIGS.items()},
        "goals": GOALS,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
