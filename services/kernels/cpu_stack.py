"""The cpu backend's whole decode steps: a pure decode step of a few sequences runs the
decoder stack in one native call per thread of an OpenMP team (``csrc/epd_decode.c``,
``csrc/epd_parallel.c``; why in docs/cpu-performance.md). ``NativeStack.run`` is
``CpuBackend.decode_stack``."""

from __future__ import annotations

import ctypes
import os

import torch

from services.kernels.cpu_native import fp32 as _fp32
from services.kernels.cpu_native import gemv_layout
from services.kernels.cpu_native import ptr as _ptr
from services.kernels.metadata import DecoderStack

_F32 = torch.float32

# epd_decode_stack's error codes
_STACK_ERRORS = {
    -1: (MemoryError, "decode_stack: out of memory for its scratch"),
    -2: (IndexError, "rotary: position outside the cos/sin table"),
    -3: (IndexError, "write_kv: slot outside the KV cache"),
    -4: (
        ValueError,
        "attention: a context longer than its block table, or a block id outside the KV cache",
    ),
    -5: (RuntimeError, "decode_stack: a thread of the team never joined the step"),
    -6: (IndexError, "decode_greedy: a token id outside the embedding table"),
}


class _StackPointers:
    """A DecoderStack and KV caches as the native step takes them: a [layers, 14] table of
    addresses, checked once. Holds the tensors, so the addresses stay valid."""

    def __init__(self, stack: DecoderStack, kv_caches, lib: ctypes.CDLL):
        self.stack, self.kv_caches, self.lib = stack, kv_caches, lib
        s = stack
        hq, hkv, d, hid, inter = (
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.hidden_size,
            s.intermediate_size,
        )
        qkvw = (hq + 2 * hkv) * d
        k0 = kv_caches[0][0]
        self.num_blocks, self.block_size = k0.shape[0], k0.shape[1]
        cache_shape = (self.num_blocks, self.block_size, hkv, d)
        rot = s.rope.shape[-1] if s.rope.dim() == 2 else -1
        self.ok = (
            len(s.layers) == len(kv_caches) > 0
            and _fp32(s.final_norm, s.rope)
            and 0 < rot <= d
            and rot % 2 == 0
            and s.final_norm.shape == (hid,)
            and hq % hkv == 0
        )
        rows = []
        for w, (kc, vc) in zip(s.layers, kv_caches, strict=False):
            if not self.ok:
                break
            mats = [
                (w.qkv, qkvw, hid),
                (w.o, hid, hq * d),
                (w.gate_up, 2 * inter, hid),
                (w.down, hid, inter),
            ]
            vecs = [
                (w.input_norm, hid),
                (w.post_norm, hid),
                (w.qkv_bias, qkvw),
                (w.o_bias, hid),
                (w.gate_up_bias, 2 * inter),
                (w.down_bias, hid),
                (w.q_norm, d),
                (w.k_norm, d),
            ]
            self.ok = (
                all(
                    m.dtype is _F32 and m.shape == (n, k) and m.stride() == (1, n)
                    for m, n, k in mats
                )
                and all(v is None or (_fp32(v) and v.shape == (n,)) for v, n in vecs)
                and (w.q_norm is None) == (w.k_norm is None)
                and _fp32(kc, vc)
                and kc.shape == vc.shape == cache_shape
            )
            rows.append(
                [
                    _ptr(w.input_norm),
                    _ptr(w.qkv),
                    _ptr(w.qkv_bias),
                    _ptr(w.q_norm),
                    _ptr(w.k_norm),
                    _ptr(w.o),
                    _ptr(w.o_bias),
                    _ptr(w.post_norm),
                    _ptr(w.gate_up),
                    _ptr(w.gate_up_bias),
                    _ptr(w.down),
                    _ptr(w.down_bias),
                    _ptr(kc),
                    _ptr(vc),
                ]
            )
        self.table = torch.tensor([[p or 0 for p in r] for r in rows], dtype=torch.int64)
        self.dims = [hid, hq, hkv, d, inter, rot, s.rope.shape[0], self.num_blocks, self.block_size]
        self._buffers: tuple | None = None

    def buffers(self, m: int, tables: torch.Tensor, team: int, timeout_ms: int, vocab: int = 0):
        """(sizes, scratch, barrier) of a step (of greedy steps over ``vocab`` logits when
        vocab > 0), kept while the step's shape recurs: a team leaves its barrier at zero
        arrivals and no error, ready for the next step."""
        key = (m, tables.stride(0), tables.shape[1], team, vocab)
        held = self._buffers[0] if self._buffers is not None else None
        # A burst's scratch starts with a step's: single steps between bursts reuse it.
        if held is not None and vocab == 0 and held[:4] == key[:4]:
            return self._buffers[1:]
        if held != key:
            dims = torch.tensor(
                [m, *self.dims, key[1], key[2], len(self.stack.layers)], dtype=torch.int64
            )
            size = (
                self.lib.epd_decode_greedy_scratch(_ptr(dims), team, vocab)
                if vocab
                else self.lib.epd_decode_scratch(_ptr(dims), team)
            )
            scratch = torch.empty(size, dtype=_F32)
            sync = torch.tensor([0, 0, 0, timeout_ms], dtype=torch.int64)
            self._buffers = (key, dims, scratch, sync)
        return self._buffers[1:]

    def drop_buffers(self) -> None:
        self._buffers = None

    def matches(self, stack: DecoderStack, kv_caches) -> bool:
        if stack is not self.stack or len(kv_caches) != len(self.kv_caches):
            return False
        return all(
            a[0] is b[0] and a[1] is b[1] for a, b in zip(kv_caches, self.kv_caches, strict=True)
        )


class _AuxOut:
    """The outputs of ``layers`` (residual stream after the layer) that a step copies out,
    rows concatenated in the order named, as ``DecoderModel.forward(aux_layers=...)``
    returns them. ``ok`` is False for a layer the stack lacks or named twice."""

    def __init__(self, stack: DecoderStack, m: int, layers: tuple[int, ...]):
        n, hid = len(stack.layers), stack.hidden_size
        self.ok = len(set(layers)) == len(layers) and all(0 <= i < n for i in layers)
        self.out = torch.empty(m, len(layers) * hid, dtype=_F32) if layers and self.ok else None
        self.stride = len(layers) * hid
        cols = [-1] * n
        for j, i in enumerate(layers if self.ok else ()):
            cols[i] = j * hid
        self.cols = torch.tensor(cols, dtype=torch.int64) if self.out is not None else None


class NativeStack:
    """Runs DecoderStacks through epd_decode_stack, keeping the checked pointer table of
    the last one (a model's stack and KV caches stay the same from step to step)."""

    def __init__(
        self, lib: ctypes.CDLL, max_rows: int, cpus: int | None = None, team_timeout_ms: int = 0
    ):
        self.lib = lib
        self.max_rows = max_rows  # the GEMV's rows: more sequences run layer by layer
        self.team_timeout_ms = team_timeout_ms  # 0: the C default (30 s)
        self._pointers: _StackPointers | None = None
        if cpus is None:
            cpus = (
                len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1)
            )
        self._cpus = cpus
        self._openmp = bool(lib.epd_openmp())

    def _inputs(self, stack: DecoderStack, m: int, positions, kv_caches, meta):
        """(pointers, positions, slots, block tables, lengths) of a pure decode step of m
        sequences in the native layouts, or None when the native step cannot take it."""
        if m == 0 or m > self.max_rows or meta.max_query_len != 1 or meta.num_seqs != m:
            return None
        if self._pointers is None or not self._pointers.matches(stack, kv_caches):
            self._pointers = _StackPointers(stack, kv_caches, self.lib)
        if not self._pointers.ok:
            return None
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        if (
            pos.numel() != m
            or slots.numel() != m
            or lens.numel() != m
            or tables.dim() != 2
            or tables.shape[0] < m
        ):
            return None
        return self._pointers, pos, slots, tables, lens

    def _team(self) -> int:
        # A team waits at a barrier for its slowest thread: never more threads than CPUs,
        # and one without OpenMP (nothing to run the others on).
        if not self._openmp:
            return 1
        return max(1, min(torch.get_num_threads(), self._cpus))

    def _run_team(self, sp: _StackPointers, team: int, call) -> None:
        """call(team, codes): the step on a team of OpenMP threads (epd_parallel.c)."""
        codes = (ctypes.c_int * team)()
        call(team, codes)
        rc = next((c for c in codes if c), 0)
        if rc:
            sp.drop_buffers()  # the barrier may be mid-count: never reuse it
            exc, msg = _STACK_ERRORS.get(rc, (RuntimeError, f"decode_stack failed ({rc})"))
            raise exc(msg)

    def run(
        self,
        stack: DecoderStack,
        positions,
        hidden,
        kv_caches,
        meta,
        aux_layers: tuple[int, ...] = (),
    ):
        """``Backend.decode_stack``."""
        m = hidden.shape[0]
        if hidden.dim() != 2 or not _fp32(hidden) or hidden.shape[1] != stack.hidden_size:
            return None
        inputs = self._inputs(stack, m, positions, kv_caches, meta)
        aux = _AuxOut(stack, m, aux_layers)
        if inputs is None or not aux.ok:
            return None
        sp, pos, slots, tables, lens = inputs
        team = self._team()
        dims, scratch, sync = sp.buffers(m, tables, team, self.team_timeout_ms)
        out = torch.empty_like(hidden)
        self._run_team(
            sp,
            team,
            lambda nt, codes: self.lib.epd_par_decode_stack(
                _ptr(out),
                _ptr(aux.out),
                _ptr(aux.cols),
                aux.stride,
                _ptr(hidden),
                _ptr(sp.table),
                _ptr(stack.final_norm),
                _ptr(stack.rope),
                _ptr(pos),
                _ptr(slots),
                _ptr(tables),
                _ptr(lens),
                _ptr(dims),
                stack.eps,
                stack.head_dim**-0.5,
                _ptr(scratch),
                _ptr(sync),
                nt,
                codes,
            ),
        )
        return (out, aux.out) if aux_layers else out

    def run_greedy(
        self, stack: DecoderStack, embed, head, tokens, positions, kv_caches, meta, steps: int
    ):
        """``Backend.decode_greedy``."""
        m = tokens.shape[0]
        vocab, hid = head.shape
        transposed = gemv_layout(head)  # W^T (models' column-major) or W (a tied head)
        if (
            steps < 1
            or tokens.dim() != 1
            or transposed is None
            or not _fp32(embed)
            or hid != stack.hidden_size
            or embed.shape != head.shape
        ):
            return None
        inputs = self._inputs(stack, m, positions, kv_caches, meta)
        if inputs is None:
            return None
        sp, pos, _, tables, lens = inputs
        ids = tokens.to(torch.int64).contiguous()
        team = self._team()
        dims, scratch, sync = sp.buffers(m, tables, team, self.team_timeout_ms, vocab)
        out = torch.empty(steps, m, dtype=torch.int64)
        self._run_team(
            sp,
            team,
            lambda nt, codes: self.lib.epd_par_decode_greedy(
                _ptr(out),
                _ptr(ids),
                _ptr(embed),
                _ptr(head),
                transposed,
                vocab,
                steps,
                _ptr(sp.table),
                _ptr(stack.final_norm),
                _ptr(stack.rope),
                _ptr(pos),
                _ptr(tables),
                _ptr(lens),
                _ptr(dims),
                stack.eps,
                stack.head_dim**-0.5,
                _ptr(scratch),
                _ptr(sync),
                nt,
                codes,
            ),
        )
        return out
