"""One decode step of a Mamba-2 layer against one of an attention layer of the same width
at a 2k-token context: what a hybrid model saves per layer it makes recurrent.

    python bench/mamba_decode.py                 # one thread, about a minute
    python bench/mamba_decode.py --threads 2 --context 8192

Both layers are Nemotron-H-shaped at hidden 2048, fp32, random weights, on the cpu
backend: the Mamba-2 mixer with 64 heads of 64 (inner 4096), state 128, 8 groups,
convolution 4 (services/models/mamba2.py); attention with 16 query and 4 KV heads of 128
on the paged KV cache (block 16), every sequence ``--context`` tokens long. A step is
one token per sequence, at batch 1 and 8, timed two ways: the whole layer (projections
included: the Mamba layer's are 2.7x the attention layer's weights, as its inner width is
twice the hidden size) and its core, the part that reads what the sequence left behind
(the convolution window and SSM state update; attention over the cached K/V), which is
what grows with the context for attention and not for Mamba. Median of 50 steps each,
all four interleaved. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.step_meta import attn_meta  # noqa: E402
from services.kernels.backend import get_backend  # noqa: E402
from services.models.llama_layers import Attention  # noqa: E402
from services.models.mamba2 import Mamba2Mixer  # noqa: E402
from services.models.rope import cos_sin_cache  # noqa: E402

HIDDEN, BLOCK = 2048, 16


def mamba_step(backend, batch: int):
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(
        hidden_size=HIDDEN,
        mamba_num_heads=64,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        layers_block_type=["linear_attention", "full_attention"],
    )
    mixer = Mamba2Mixer(cfg, backend)
    for p in mixer.parameters():
        p.data.normal_(0, 0.02)
    conv, ssm = mixer.state_shapes()
    state = (torch.zeros(batch, *conv), torch.zeros(batch, *ssm))
    slots, qlens = torch.arange(batch), [1] * batch
    h = torch.randn(batch, HIDDEN)
    xbc, dt = torch.randn(batch, mixer.conv_dim), torch.randn(batch, mixer.heads)
    state_bytes = (state[0][0].numel() + state[1][0].numel()) * 4
    layer = lambda: mixer(h, state, qlens, slots)  # noqa: E731
    core = lambda: mixer._steps(xbc, dt, state, slots)  # noqa: E731
    return layer, core, state_bytes


def attention_step(backend, batch: int, context: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=context + 1,
    )
    attn = Attention(cfg, backend, qkv_bias=False, qk_norm=False)
    for p in attn.parameters():
        p.data.normal_(0, 0.02)
    per_seq = -(-context // BLOCK)
    kv = torch.randn(2, batch * per_seq, BLOCK, 4, 128)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    pos = context - 1
    slots = [t[pos // BLOCK] * BLOCK + pos % BLOCK for t in tables]
    meta = attn_meta(
        qlens=[1] * batch,
        seqlens=[context] * batch,
        tables=tables,
        slots=slots,
        device=torch.device("cpu"),
    )
    rope = cos_sin_cache(cfg, 128, context + 1)
    positions = torch.full((batch,), pos)
    h = torch.randn(batch, HIDDEN)
    q = torch.randn(batch, 16, 128)
    kv_bytes = 2 * context * 4 * 128 * 4
    layer = lambda: attn(positions, h, (kv[0], kv[1]), meta, rope)  # noqa: E731
    core = lambda: backend.attention(q, kv[0], kv[1], meta, attn.scale)  # noqa: E731
    return layer, core, kv_bytes


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = get_backend("cpu", torch.device("cpu"))
    result = {"threads": args.threads, "context": args.context, "hidden": HIDDEN, "batches": {}}
    with torch.inference_mode():
        for batch in (1, 8):
            mamba, mamba_core, state_bytes = mamba_step(backend, batch)
            attn, attn_core, kv_bytes = attention_step(backend, batch, args.context)
            fns = {"mamba": mamba, "attention": attn, "mamba_core": mamba_core}
            fns["attention_core"] = attn_core
            for fn in fns.values():  # warm-up: kernels compiled, weights packed
                timed(fn, 3)
            times = {name: [] for name in fns}
            for _ in range(args.steps // 5):  # interleaved
                for name, fn in fns.items():
                    times[name] += timed(fn, 5)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            result["batches"][batch] = {
                **{f"{name}_ms": round(v, 3) for name, v in ms.items()},
                "layer_attention_over_mamba": round(ms["attention"] / ms["mamba"], 2),
                "core_attention_over_mamba": round(ms["attention_core"] / ms["mamba_core"], 2),
                "mamba_state_kib_per_seq": state_bytes // 1024,
                "attention_kv_kib_per_seq": kv_bytes // 1024,
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
