"""CPU backend: the torch backend with its decode hot path on native kernels.

Chosen by ``get_backend`` on CPU when the kernels in ``csrc/`` build (see ``cpu_native``).
fp32 only: any other dtype, or a layout the kernels do not take, falls back to the torch
op of the same contract, so the backend is always complete.

- Attention reads K/V in place from the paged cache (torch must gather blocks, then SDPA
  reads them again): decode rows one at a time, prefill chunks in tiles of queries that
  share each key read (``cpu_attention`` plans which rows go where).
- Linear: a streaming GEMV for 1-32 rows (batch-1 decode is bound by weight reads) on W^T
  (the column-major weights models keep on CPU) or W row-major (a tied LM head, i.e. the
  embedding table: see epd_gemv_rm), and beyond, a GEMM (``cpu_gemm``): oneDNN's on AMD
  CPUs, over packed copies of the weights while a memory budget lasts, MKL's on Intel;
  F.linear for a few rows on other layouts.
- SiLU x mul, RMSNorm (with the residual add), rotary and greedy argmax as single passes.
- Greedy tokens through a bfloat16 screen of the LM head where the CPU multiplies
  bfloat16 (``cpu_head``): the fp32 logits' argmax in about half the head's time.
- A pure decode step of up to GEMV_MAX_ROWS sequences runs the whole decoder stack in one
  native call per thread (``decode_stack``, see ``cpu_stack``): op by op, Python dispatch
  cost about as much as the weight reads.
Work is split across ``torch.get_num_threads()`` threads of the OpenMP team torch's own ops
run on (``csrc/epd_parallel.c``; ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn.functional as F

from services.config import EngineConfig
from services.kernels import cpu_native, kv_quant
from services.kernels import torch_backend as ref
from services.kernels.cpu_attention import AttentionPlan, extend_one_split, plan_key
from services.kernels.cpu_gemm import GEMM_MIN_ROWS, OneDnnGemm, prefer_mkldnn
from services.kernels.cpu_head import ScreenedHead, bf16_linear_works, has_native_bf16
from services.kernels.cpu_stack import NativeStack
from services.kernels.metadata import AttentionMetadata, DecoderStack
from services.kernels.quant import QuantizedWeight

# Up to this many rows the native GEMV (and so the one-call decode step) beats oneDNN on a
# weight-bound model: it loads each weight vector once for up to 32 rows (epd_gemv_rows.c).
# The 56 M peers Llama's 32 layer matrices on an AVX-512 core, with FMA: 18.1 against
# 24.9 ms at 32 rows, its LM head 12.1 against 17.8; at 48 rows 27.2 against 28.6, at 64
# a tie (33.3 against 32.7): past 32 the one-call step's gain is gone (a cap of 64: w64
# 0.96x at one thread, 1.01x at two; docs/cpu-performance.md, "Multi-row GEMV" and
# "FMA and AVX-512").
GEMV_MAX_ROWS = 32
# epd_gemv_rm (row-major W: a tied LM head) has no multi-row kernel: its measured cap.
GEMV_RM_MAX_ROWS = 16
PACKED_WEIGHTS_MB = EngineConfig.packed_weights_mb  # the default (see cpu_gemm.OneDnnGemm)
_F32 = torch.float32
_ptr, _fp32, _layout = cpu_native.ptr, cpu_native.fp32, cpu_native.gemv_layout
_bounds = cpu_native.bounds


class CpuBackend:
    """Backend object (see ``services.kernels.backend``) over the native CPU kernels."""

    name = "cpu"
    stack_max_rows = GEMV_MAX_ROWS
    write_kv = staticmethod(ref.write_kv)

    def __init__(
        self,
        lib: ctypes.CDLL,
        greedy_head_screen: str = "auto",
        packed_weights_mb: int = PACKED_WEIGHTS_MB,
    ):
        self.lib = lib
        self.onednn = OneDnnGemm(packed_weights_mb) if prefer_mkldnn() else None
        on = {"on": True, "off": False}.get(greedy_head_screen)
        self.screen_heads = has_native_bf16() if on is None else on and bf16_linear_works()
        self._screens: dict[int, tuple[weakref.ref, ScreenedHead]] = {}
        self._plan: tuple[weakref.ref | None, AttentionPlan | None] = (None, None)
        self._checked_positions: tuple[weakref.ref | None, int] = (None, 0)
        self._native_stack = NativeStack(lib, GEMV_MAX_ROWS)

    @classmethod
    def create(
        cls,
        kernel_cache_dir: str = "",
        compiler: str = "cc",
        greedy_head_screen: str = "auto",
        packed_weights_mb: int = PACKED_WEIGHTS_MB,
    ) -> CpuBackend | None:
        lib = cpu_native.load(kernel_cache_dir or cpu_native.default_cache_dir(), compiler)
        if lib is None:
            return None
        cpu_native.keep_freed_memory()
        return cls(lib, greedy_head_screen, packed_weights_mb)

    # -- threading ------------------------------------------------------------------
    def _split(self, n: int, min_chunk: int) -> list[tuple[int, int]]:
        if n < 2 * min_chunk:
            return [(0, n)] if n else []
        parts = max(1, min(torch.get_num_threads(), n // max(min_chunk, 1)))
        step = -(-n // parts)
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    # -- attention ------------------------------------------------------------------
    def _attention_plan(self, meta: AttentionMetadata, k_cache, hq: int) -> AttentionPlan:
        ref_, plan = self._plan
        if ref_ is None or ref_() is not meta or plan.key != plan_key(k_cache, hq):
            plan = AttentionPlan(meta, k_cache, hq)
            self._plan = (weakref.ref(meta), plan)
        return plan

    def attention(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        quantized = kv_quant.is_quantized(k_cache)
        native = _fp32(query) and (
            quantized and query.shape[2] % 8 == 0 or not quantized and _fp32(k_cache, v_cache)
        )
        if not native or query.shape[0] == 0:
            return ref.attention(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        plan = self._attention_plan(meta, k_cache, query.shape[1])
        if query.shape[0] != plan.starts[-1]:
            raise ValueError("attention: query rows do not match the metadata")
        _, bs, hkv, _ = k_cache.shape
        hq, d, ts = query.shape[1], query.shape[2], plan.tables.stride(0)

        common = (_ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(plan.tables), ts)
        row_args = (_ptr(plan.lens), _ptr(plan.rows), _ptr(plan.seqs), hq, hkv, d, bs, scale)
        bounds = _bounds(self._split(plan.num_rows, 8))
        if quantized:
            fp8 = kv_quant.format_of(k_cache) == "fp8"
            rc = self.lib.epd_par_decode_attention_q8(*common, *row_args, fp8, *bounds)
        else:
            rc = self.lib.epd_par_decode_attention(*common, *row_args, *bounds)
        if rc != 0:
            raise MemoryError("attention: out of memory for its scratch")
        rc = self.lib.epd_par_extend_attention(
            *common,
            _ptr(plan.units),
            hq,
            hkv,
            d,
            bs,
            scale,
            *_bounds(plan.unit_ranges(torch.get_num_threads())),
        )
        if rc == -1:
            raise MemoryError("attention: out of memory for its scratch")
        if rc != 0:
            raise ValueError("attention: a tile the kernel does not take")
        if plan.sdpa_meta is not None:
            ref.extend_rows(
                query,
                k_cache,
                v_cache,
                plan.sdpa_meta,
                scale,
                out,
                plan.starts,
                one=extend_one_split,
            )
        return out

    # -- whole decode step -----------------------------------------------------------
    def decode_stack(
        self,
        stack: DecoderStack,
        positions,
        hidden,
        kv_caches,
        meta,
        aux_layers: tuple[int, ...] = (),
    ):
        return self._native_stack.run(stack, positions, hidden, kv_caches, meta, aux_layers)

    def decode_greedy(self, stack, embed, head, tokens, positions, kv_caches, meta, steps: int):
        return self._native_stack.run_greedy(
            stack, embed, head, tokens, positions, kv_caches, meta, steps
        )

    def greedy_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        screen = self._screen(weight) if self.screen_heads and x.dim() == 2 else None
        if screen is None or not _fp32(x) or x.shape[0] == 0:
            return self._fp32_greedy(x, weight)
        out = screen(x)
        left = out < 0  # rows the screen could not settle (many candidates, non-finite)
        if bool(left.any()):
            out[left] = self._fp32_greedy(x[left].contiguous(), weight)
        return out

    def _screen(self, weight: torch.Tensor) -> ScreenedHead | None:
        """The screen of this head, made on its first greedy step and again after the head
        is written in place (None: the fp32 head's layout is not one the kernels read)."""
        held = self._screens.get(id(weight))
        if held is not None and held[0]() is weight and held[1].version == weight._version:
            return held[1]
        layout = _layout(weight)
        if layout is None:
            return None
        screen = ScreenedHead(self.lib, weight, layout, self._split)
        self._screens[id(weight)] = (weakref.ref(weight), screen)
        return screen

    def _fp32_greedy(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, (n, k) = x.shape[0], weight.shape
        layout = _layout(weight)
        if (
            x.dim() != 2
            or rows > (GEMV_MAX_ROWS if layout else GEMV_RM_MAX_ROWS)
            or torch.get_num_threads() != 1
            or weight.dtype != _F32
            or layout is None
            or not _fp32(x)
        ):
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
        self.lib.epd_par_argmax(_ptr(out), _ptr(logits), n, *_bounds(self._split(m, 8)))
        return out

    def sample(self, logits: torch.Tensor, t) -> torch.Tensor:
        if not t.all_greedy or logits.dim() != 2 or not _fp32(logits):
            return ref.sample(logits, t)
        return self._argmax(logits)

    # -- dense ops ------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None):
        if isinstance(weight, QuantizedWeight):
            return self._quantized(x, weight, bias)
        rows = x.shape[0]
        if x.dim() != 2 or x.dtype != _F32 or weight.dtype != _F32 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        n, k = weight.shape
        layout = _layout(weight) if rows <= GEMV_MAX_ROWS and _fp32(x) else None
        if layout is not None and (layout or rows <= GEMV_RM_MAX_ROWS):
            return self._gemv(x, weight, bias, n, k, layout)
        if rows >= GEMM_MIN_ROWS and self.onednn is not None:
            return self.onednn(x, weight, bias)
        return F.linear(x, weight, bias)

    def _gemv(self, x, weight, bias, n: int, k: int, transposed: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=_F32)
        b = bias if bias is not None and _fp32(bias) else None

        self.lib.epd_par_gemv(
            _ptr(y),
            _ptr(x),
            _ptr(weight),
            _ptr(b),
            x.shape[0],
            k,
            n,
            transposed,
            *_bounds(self._split(n, 2048)),
        )
        if bias is not None and b is None:
            y += bias
        return y

    def _quantized(self, x, w: QuantizedWeight, bias) -> torch.Tensor:
        """x @ W^T + bias with W's codes read by the native kernels (csrc/epd_quant.c)."""
        n, k = w.shape
        if (
            x.dim() != 2
            or x.shape[1] != k
            or not _fp32(x, w.scale)
            or (bias is not None and not _fp32(bias))
            or not w.codes.is_cpu
        ):
            return ref.linear(x, w, bias)
        m = x.shape[0]
        y = torch.empty(m, n, dtype=_F32)
        if m == 0:
            return y
        # Whole panels per thread; a weight of a few panels stays on one.
        ranges = _bounds(self._split(w.codes.shape[0], 8))
        if w.method == "int8":
            self.lib.epd_par_qgemv_i8(
                _ptr(y), _ptr(x), m, k, n, _ptr(w.codes), _ptr(w.scale), _ptr(bias), *ranges
            )
            return y
        sums = torch.empty(m, k // w.group, dtype=_F32)
        self.lib.epd_group_sums(_ptr(sums), _ptr(x), k, m, k, w.group)
        self.lib.epd_par_qgemv_i4(
            _ptr(y),
            _ptr(x),
            _ptr(sums),
            m,
            k,
            n,
            w.group,
            _ptr(w.codes),
            _ptr(w.scale),
            _ptr(w.offset),
            w.scale.shape[1],
            _ptr(bias),
            *ranges,
        )
        return y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not _fp32(x):
            return ref.silu_mul(x)
        m, h = x.shape[0], x.shape[1] // 2
        out = torch.empty(m, h, dtype=_F32)
        self.lib.epd_par_silu_mul(_ptr(out), _ptr(x), h, *_bounds(self._split(m, 64)))
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

        self.lib.epd_par_rotary(
            _ptr(query),
            _ptr(key),
            _ptr(pos),
            _ptr(cos_sin_cache),
            hq,
            hkv,
            d,
            rot,
            int(is_neox),
            *_bounds(self._split(t, 256)),
        )

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

        self.lib.epd_par_rms_norm(
            _ptr(out),
            _ptr(res_out),
            _ptr(x),
            _ptr(residual),
            _ptr(weight),
            h,
            eps,
            *_bounds(self._split(m, 256)),
        )
        return out if residual is None else (out, res_out)
