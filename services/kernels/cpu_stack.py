"""The cpu backend's whole decode steps: a pure decode step of a few sequences runs the
decoder stack in one native call per thread of an OpenMP team (``csrc/epd_decode.c``,
``csrc/epd_parallel.c``; why in docs/cpu-performance.md). ``NativeStack.run`` is
``CpuBackend.decode_stack``; the stack's native layouts are in ``cpu_stack_layout``."""

from __future__ import annotations

import ctypes
import os

import torch

from services.kernels.cpu_native import fp32 as _fp32
from services.kernels.cpu_native import gemv_layout
from services.kernels.cpu_native import ptr as _ptr
from services.kernels.cpu_stack_layout import AuxOut, StackPointers
from services.kernels.metadata import DecoderStack

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


class NativeStack:
    """Runs DecoderStacks through epd_decode_stack, keeping the checked pointer table of
    the last one (a model's stack and KV caches stay the same from step to step)."""

    def __init__(
        self, lib: ctypes.CDLL, max_rows: int, cpus: int | None = None, team_timeout_ms: int = 0
    ):
        self.lib = lib
        self.max_rows = max_rows  # the GEMV's rows: more sequences run layer by layer
        self.team_timeout_ms = team_timeout_ms  # 0: the C default (30 s)
        self._pointers: StackPointers | None = None
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
            self._pointers = StackPointers(stack, kv_caches, self.lib)
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

    def _run_team(self, sp: StackPointers, team: int, call) -> None:
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
        aux = AuxOut(stack, m, aux_layers)
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
