"""A decode step's DecoderStack as the native step (``csrc/epd_decode.c``) takes it: the
checked [layers, 18] pointer table with the step's scratch buffers (``StackPointers``),
and where the outputs of chosen layers are copied (``AuxOut``). ``NativeStack``
(cpu_stack.py) runs the step over them."""

from __future__ import annotations

import ctypes

import torch

from services.kernels import kv_quant
from services.kernels.cpu_native import fp32 as _fp32
from services.kernels.cpu_native import ptr as _ptr
from services.kernels.metadata import DecoderStack
from services.kernels.quant import QuantizedWeight

# dims[D_KV_FORMAT] of epd_decode.c: 0 a float cache, else its codes' kind (epd_kvq8.c)
KV_FORMATS = {"int8": 1, "fp8": 2}

_F32 = torch.float32


def _layer_pointers(w, kc, vc, descriptors: list) -> list[int | None]:
    """One layer's row of the table, in the order csrc/epd_decode.c reads it; the
    descriptors of its quantized linears are appended to ``descriptors`` (kept alive)."""

    def weight(t):
        return None if isinstance(t, QuantizedWeight) else _ptr(t)

    def quantized(t):
        if not isinstance(t, QuantizedWeight):
            return None
        d = torch.tensor(
            [
                8 if t.method == "int8" else 4,
                t.group,
                t.scale.shape[-1],
                _ptr(t.codes),
                _ptr(t.scale),
                _ptr(t.offset) or 0,
            ],
            dtype=torch.int64,
        )
        descriptors.append(d)
        return _ptr(d)

    return [
        _ptr(w.input_norm),
        weight(w.qkv),
        _ptr(w.qkv_bias),
        _ptr(w.q_norm),
        _ptr(w.k_norm),
        weight(w.o),
        _ptr(w.o_bias),
        _ptr(w.post_norm),
        weight(w.gate_up),
        _ptr(w.gate_up_bias),
        weight(w.down),
        _ptr(w.down_bias),
        _ptr(kc),
        _ptr(vc),
        quantized(w.qkv),
        quantized(w.o),
        quantized(w.gate_up),
        quantized(w.down),
    ]


def _readable(m, n: int, k: int) -> bool:
    """A linear weight [n, k] the native step reads: W^T fp32, or quantized codes on CPU."""
    if isinstance(m, QuantizedWeight):
        return m.shape == (n, k) and m.codes.is_cpu and _fp32(m.scale)
    return m.dtype is _F32 and m.shape == (n, k) and m.stride() == (1, n)


class StackPointers:
    """A DecoderStack and KV caches as the native step takes them: a [layers, 18] table of
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
        # quantized caches (kv_quant.py): rows of codes and scale, read by epd_kvq8.c
        quantized = kv_quant.is_quantized(k0)
        self.kv_format = KV_FORMATS[kv_quant.format_of(k0)] if quantized else 0
        width = kv_quant.row_width(d) if quantized else d
        cache_shape = (self.num_blocks, self.block_size, hkv, width)
        rot = s.rope.shape[-1] if s.rope.dim() == 2 else -1
        self.ok = (
            len(s.layers) == len(kv_caches) > 0
            and _fp32(s.final_norm, s.rope)
            and 0 < rot <= d
            and rot % 2 == 0
            and s.final_norm.shape == (hid,)
            and hq % hkv == 0
        )
        rows, self._descriptors = [], []
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
                all(_readable(m, n, k) for m, n, k in mats)
                and all(v is None or (_fp32(v) and v.shape == (n,)) for v, n in vecs)
                and (w.q_norm is None) == (w.k_norm is None)
                and (
                    kv_quant.is_quantized(k0, kc, vc) and d % 8 == 0 if quantized else _fp32(kc, vc)
                )
                and kc.shape == vc.shape == cache_shape
            )
            rows.append(_layer_pointers(w, kc, vc, self._descriptors))
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
                [m, *self.dims, key[1], key[2], len(self.stack.layers), self.kv_format],
                dtype=torch.int64,
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


class AuxOut:
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
