"""CPU backend: the torch backend with its decode hot path on native kernels.

Chosen by ``get_backend`` on CPU when the kernels in ``csrc/`` build (see ``cpu_native``).
fp32 only: any other dtype, or a layout the kernels do not take, falls back to the torch
op of the same contract, so the backend is always complete.

- Attention reads K/V in place from the paged cache (torch must gather blocks, then SDPA
  reads them again): decode rows one at a time, prefill chunks in tiles of queries that
  share each key read (``cpu_attention`` plans which rows go where).
- Linear: a streaming GEMV for 1-32 rows (batch-1 decode is bound by weight reads) on W^T
  (the column-major weights models keep on CPU) or W row-major (a tied LM head, i.e. the
  embedding table: see epd_gemv_rm), and
  oneDNN's fp32 GEMM beyond (5-25 % faster than MKL's on the shapes of a decode step on
  this AMD CPU, where MKL does not use its AVX-512 path); F.linear for a few rows on other
  layouts.
- SiLU x mul, RMSNorm (with the residual add), rotary and greedy argmax as single passes.
- A pure decode step of up to GEMV_MAX_ROWS sequences runs the whole decoder stack in one
  native call per thread (``decode_stack``, see ``cpu_stack``): op by op, Python dispatch
  cost about as much as the weight reads.
Work is split across ``torch.get_num_threads()`` threads (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from services.kernels import cpu_native
from services.kernels import torch_backend as ref
from services.kernels.cpu_attention import AttentionPlan
from services.kernels.cpu_stack import NativeStack
from services.kernels.metadata import AttentionMetadata, DecoderStack

# Up to this many rows the native GEMV (and so the one-call decode step) beats oneDNN on a
# weight-bound model: it loads each weight vector once for up to 32 rows (epd_gemv_rows.c).
# The 56 M peers Llama's 32 layer matrices at 32 rows: 42.6 against 51.8 ms, its LM head
# 29.2 against 29.2 ms; at 48 rows oneDNN wins (57 against 63 ms); a 32-row verify step
# in one call 74 against 89 ms through the layers (docs/cpu-performance.md, "Multi-row GEMV").
GEMV_MAX_ROWS = 32
# epd_gemv_rm (row-major W: a tied LM head) has no multi-row kernel: its measured cap.
GEMV_RM_MAX_ROWS = 16
GEMM_MIN_ROWS = 8
_F32 = torch.float32
_ptr, _fp32, _layout = cpu_native.ptr, cpu_native.fp32, cpu_native.gemv_layout


def _mkldnn_linear_works() -> bool:
    try:
        x, w = torch.ones(GEMM_MIN_ROWS, 4), torch.ones(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return bool(torch.equal(y, F.linear(x, w)))
    except (RuntimeError, AttributeError):
        return False


class CpuBackend:
    """Backend object (see ``services.kernels.backend``) over the native CPU kernels."""

    name = "cpu"
    stack_max_rows = GEMV_MAX_ROWS
    write_kv = staticmethod(ref.write_kv)

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.use_mkldnn = _mkldnn_linear_works()
        self._plan: tuple[weakref.ref | None, AttentionPlan | None] = (None, None)
        self._checked_positions: tuple[weakref.ref | None, int] = (None, 0)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._native_stack = NativeStack(lib, GEMV_MAX_ROWS)

    @classmethod
    def create(cls, kernel_cache_dir: str = "", compiler: str = "cc") -> CpuBackend | None:
        lib = cpu_native.load(kernel_cache_dir or cpu_native.default_cache_dir(), compiler)
        if lib is None:
            return None
        cpu_native.keep_freed_memory()
        return cls(lib)

    # -- threading ------------------------------------------------------------------
    def _split(self, n: int, min_chunk: int) -> list[tuple[int, int]]:
        if n < 2 * min_chunk:
            return [(0, n)] if n else []
        parts = max(1, min(torch.get_num_threads(), n // max(min_chunk, 1)))
        step = -(-n // parts)
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    def _run(self, fn, ranges: list[tuple[int, int]]) -> None:
        """fn(lo, hi) over the ranges: the last one here, the others on pool threads."""
        if len(ranges) <= 1:
            for lo, hi in ranges:
                fn(lo, hi)
            return
        if self._pool_size < len(ranges) - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool_size = len(ranges) - 1
            self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="epd-cpu")
        futures = [self._pool.submit(fn, lo, hi) for lo, hi in ranges[:-1]]
        fn(*ranges[-1])
        for f in futures:
            f.result()

    # -- attention ------------------------------------------------------------------
    def _attention_plan(self, meta: AttentionMetadata, k_cache, hq: int) -> AttentionPlan:
        ref_, plan = self._plan
        if ref_ is None or ref_() is not meta or plan.shape != (hq, *k_cache.shape[2:]):
            plan = AttentionPlan(meta, k_cache, hq)
            self._plan = (weakref.ref(meta), plan)
        return plan

    def attention(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if not _fp32(query, k_cache, v_cache) or query.shape[0] == 0:
            return ref.attention(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        plan = self._attention_plan(meta, k_cache, query.shape[1])
        if query.shape[0] != plan.starts[-1]:
            raise ValueError("attention: query rows do not match the metadata")
        _, bs, hkv, d = k_cache.shape
        hq, ts = query.shape[1], plan.tables.stride(0)

        def rows(lo: int, hi: int) -> None:
            rc = self.lib.epd_decode_attention(
                _ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(plan.tables), ts,
                _ptr(plan.lens, lo), _ptr(plan.rows, lo), _ptr(plan.seqs, lo), hi - lo,
                hq, hkv, d, bs, scale,
            )  # fmt: skip
            if rc != 0:
                raise MemoryError("attention: out of memory for its scratch")

        def tiles(lo: int, hi: int) -> None:
            rc = self.lib.epd_extend_attention(
                _ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(plan.tables), ts,
                _ptr(plan.units, 5 * lo), hi - lo, hq, hkv, d, bs, scale,
            )  # fmt: skip
            if rc == -1:
                raise MemoryError("attention: out of memory for its scratch")
            if rc != 0:
                raise ValueError("attention: a tile the kernel does not take")

        self._run(rows, self._split(plan.num_rows, 8))
        self._run(tiles, plan.unit_ranges(torch.get_num_threads()))
        if plan.sdpa_meta is not None:
            ref.extend_rows(query, k_cache, v_cache, plan.sdpa_meta, scale, out, plan.starts)
        return out

    # -- whole decode step -----------------------------------------------------------
    def decode_stack(self, stack: DecoderStack, positions, hidden, kv_caches, meta,
                     aux_layers: tuple[int, ...] = ()):  # fmt: skip
        return self._native_stack.run(stack, positions, hidden, kv_caches, meta, self._run,
                                      aux_layers)  # fmt: skip

    def decode_greedy(self, stack, embed, head, tokens, positions, kv_caches, meta, steps: int):
        return self._native_stack.run_greedy(stack, embed, head, tokens, positions, kv_caches,
                                             meta, steps, self._run)  # fmt: skip

    def greedy_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, (n, k) = x.shape[0], weight.shape
        layout = _layout(weight)
        if (
            x.dim() != 2 or rows > (GEMV_MAX_ROWS if layout else GEMV_RM_MAX_ROWS)
            or torch.get_num_threads() != 1
            or weight.dtype != _F32 or layout is None or not _fp32(x)
        ):  # fmt: skip
            return self._argmax(self.linear(x, weight).float())
        out = torch.empty(rows, dtype=torch.int64)
        if self.lib.epd_gemv_argmax(_ptr(out), _ptr(x), _ptr(weight), rows, k, n, layout):
            raise MemoryError("greedy_head: out of memory for the logits")
        return out

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or not _fp32(logits):
            return logits.argmax(dim=-1)
        m, n = logits.shape
        out = torch.empty(m, dtype=torch.int64)

        def run(lo: int, hi: int) -> None:
            self.lib.epd_argmax(_ptr(out, lo), _ptr(logits, lo * n), hi - lo, n)

        self._run(run, self._split(m, 8))
        return out

    def sample(self, logits: torch.Tensor, t) -> torch.Tensor:
        if not t.all_greedy or logits.dim() != 2 or not _fp32(logits):
            return ref.sample(logits, t)
        return self._argmax(logits)

    # -- dense ops ------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        rows = x.shape[0]
        if x.dim() != 2 or x.dtype != _F32 or weight.dtype != _F32 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        n, k = weight.shape
        layout = _layout(weight) if rows <= GEMV_MAX_ROWS and _fp32(x) else None
        if layout is not None and (layout or rows <= GEMV_RM_MAX_ROWS):
            return self._gemv(x, weight, bias, n, k, layout)
        if rows >= GEMM_MIN_ROWS and self.use_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def _gemv(self, x, weight, bias, n: int, k: int, transposed: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=_F32)
        b = bias if bias is not None and _fp32(bias) else None

        def run(lo: int, hi: int) -> None:
            if transposed:  # weight.t() is [k, n] row-major: columns lo..hi of it
                self.lib.epd_gemv_t(_ptr(y, lo), n, _ptr(x), _ptr(weight, lo), n, _ptr(b, lo),
                                    x.shape[0], k, hi - lo)  # fmt: skip
            else:  # rows lo..hi of W [n, k]
                self.lib.epd_gemv_rm(_ptr(y, lo), n, _ptr(x), _ptr(weight, lo * k), k,
                                     _ptr(b, lo), x.shape[0], k, hi - lo)  # fmt: skip

        self._run(run, self._split(n, 2048))
        if bias is not None and b is None:
            y += bias
        return y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not _fp32(x):
            return ref.silu_mul(x)
        m, h = x.shape[0], x.shape[1] // 2
        out = torch.empty(m, h, dtype=_F32)

        def run(lo: int, hi: int) -> None:
            self.lib.epd_silu_mul(_ptr(out, lo * h), _ptr(x, lo * 2 * h), hi - lo, h)

        self._run(run, self._split(m, 64))
        return out

    def rotary(self, positions, query, key, cos_sin_cache, is_neox: bool) -> None:
        pos = positions
        if pos.dtype != torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        if not _fp32(query, key, cos_sin_cache) or pos.device.type != "cpu":
            return ref.rotary(positions, query, key, cos_sin_cache, is_neox)
        t, hq, d = query.shape
        hkv, rot = key.shape[1], cos_sin_cache.shape[-1]
        self._check_positions(pos, cos_sin_cache.shape[0])

        def run(lo: int, hi: int) -> None:
            self.lib.epd_rotary(_ptr(query, lo * hq * d), _ptr(key, lo * hkv * d), _ptr(pos, lo),
                                _ptr(cos_sin_cache), hi - lo, hq, hkv, d, rot, int(is_neox))  # fmt: skip

        self._run(run, self._split(t, 256))

    def _check_positions(self, pos: torch.Tensor, table_len: int) -> None:
        """Positions index the cos/sin table in C: check them once per step, not per layer."""
        ref_, checked_len = self._checked_positions
        if ref_ is not None and ref_() is pos and checked_len == table_len:
            return
        if pos.numel() and (int(pos.max()) >= table_len or int(pos.min()) < 0):
            raise IndexError("rotary: position outside the cos/sin table")
        self._checked_positions = (weakref.ref(pos), table_len)

    def rms_norm(self, x, weight, eps: float, residual=None):
        if x.dim() != 2 or not _fp32(x, weight) or (residual is not None and not _fp32(residual)):
            return ref.rms_norm(x, weight, eps, residual)
        m, h = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else None

        def run(lo: int, hi: int) -> None:
            self.lib.epd_rms_norm(_ptr(out, lo * h), _ptr(res_out, lo * h), _ptr(x, lo * h),
                                  _ptr(residual, lo * h), _ptr(weight), hi - lo, h, eps)  # fmt: skip

        self._run(run, self._split(m, 256))
        return out if residual is None else (out, res_out)
