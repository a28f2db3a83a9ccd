"""The speculative-decoding benchmark's recipe, part 1: corpus, tokenizer, target model.

Everything is built offline from the Python standard library's own source files (every
machine has them): a byte-level BPE tokenizer trained with ``tokenizers``, then a small
Llama trained briefly on the same files. Files are split by a hash of their path: one in
ten is held out for the benchmark's prompts. Results are cached under
``~/.cache/epd-serve/spec-bench/<version>/`` (like the demo model); the recipe ships,
the weights do not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("bench.spec")

VERSION = "v2"  # v2: a weight-bound target (~11 M params, ~44 MB fp32, past the 32 MiB L3)
CACHE = Path.home() / ".cache" / "epd-serve" / "spec-bench" / VERSION
VOCAB = 1024
SPECIALS = ["<s>", "</s>", "<pad>", "<mask>"]  # <mask>: P-EAGLE's stand-in token


@dataclass(frozen=True)
class Recipe:
    """Sizes and step counts of the recipe (a few CPU-minutes per model).

    The target is sized to be weight-bound at batch 1, as served models are: its layers
    and lm_head are ~11 M fp32 parameters (~44 MB), past this machine's 32 MiB L3, so a
    decode step is dominated by streaming the weights from DRAM and a verify of 1 + k rows
    reads them once too. Head size 64 takes the attention kernel's unrolled path."""

    corpus_chars: int = 1_500_000  # training text read from the stdlib
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 1152
    seq: int = 64  # training window (tokens)
    batch: int = 16
    target_steps: int = 300  # ~1.7 s a step on one shared core: ~8 CPU-minutes
    target_lr: float = 3e-3
    eval_windows: int = 64  # held-out windows for the reported loss
    seed: int = 0


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the stdlib's .py sources, split by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for p in files if _bucket(p.relative_to(root)) == 0]
    train = [p for p in files if _bucket(p.relative_to(root)) != 0]
    return train, held


def _bucket(rel: Path) -> int:
    return hashlib.sha256(str(rel).encode()).digest()[0] % 10


def read_text(files: list[Path], limit: int) -> list[str]:
    """File contents (undecodable ones skipped) until ``limit`` characters."""
    out, total = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        total += len(text)
        if total >= limit:
            break
    return out


def build_tokenizer(texts: list[str], out: Path):
    """Byte-level BPE over the corpus, saved as a transformers fast tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=4096,
    )
    fast.save_pretrained(str(out))
    return fast


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All files' tokens, each file closed by </s>, as one long [N] tensor."""
    eos = tok.eos_token_id
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids += enc + [eos]
    return torch.tensor(ids)


def windows(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq] random windows of the stream."""
    starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


def train_target(r: Recipe, tok, stream: torch.Tensor, out: Path):
    """A small Llama trained on the stream (AdamW, warm-up then cosine); saved to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(r.seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=r.hidden,
        intermediate_size=r.intermediate,
        num_hidden_layers=r.layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        head_dim=r.hidden // r.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=r.target_lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(r.seed)
    t0 = time.perf_counter()
    for step in range(r.target_steps):
        _set_lr(opt, r.target_lr, step, r.target_steps)
        x = windows(stream, r.batch, r.seq, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == r.target_steps - 1:
            log.info(
                "target step %d/%d loss %.3f (%.0f s)",
                step,
                r.target_steps,
                loss.item(),
                time.perf_counter() - t0,
            )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out))
    return model.eval()


def _set_lr(opt, peak: float, step: int, total: int) -> None:
    warm = max(1, total // 20)
    lr = peak * step / warm if step < warm else peak * 0.5 * (1 + math.cos(math.pi * step / total))
    for g in opt.param_groups:
        g["lr"] = lr


@torch.no_grad()
def held_out_loss(r: Recipe, model, tok) -> float:
    """Mean next-token loss on ``eval_windows`` random windows of the held-out files."""
    _, held = stdlib_files()
    stream = token_stream(tok, read_text(held, r.corpus_chars // 4))
    gen = torch.Generator().manual_seed(r.seed + 7)
    x = windows(stream, r.eval_windows, r.seq, gen)
    return sum(model(input_ids=c, labels=c).loss.item() for c in x.split(16)) / len(x.split(16))


def build_target(r: Recipe = Recipe(), root: Path = CACHE) -> tuple[Path, torch.Tensor]:
    """The cached target checkpoint (built on first use) and its training token stream."""
    out = root / "target"
    train_files, _ = stdlib_files()
    texts = read_text(train_files, r.corpus_chars)
    if (out / "epd_spec_bench.json").exists():  # written last: the build completed
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out))
        return out, token_stream(tok, texts)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_tokenizer(texts, out)
    stream = token_stream(tok, texts)
    log.info("corpus: %d files, %d chars, %d tokens", len(texts), sum(map(len, texts)), len(stream))
    model = train_target(r, tok, stream, out)
    seconds = time.perf_counter() - t0
    loss = held_out_loss(r, model, tok)
    log.info("target: held-out loss %.3f (%.0f s to build)", loss, seconds)
    (out / "epd_spec_bench.json").write_text(
        json.dumps({"version": VERSION, "seconds": seconds, "held_out_loss": loss})
    )
    return out, stream
