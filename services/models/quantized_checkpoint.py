"""Checkpoints published quantized, read as they are: ``compressed-tensors`` (what
llm-compressor writes) with int8 weights, a scale per output channel (W8A8 / W8A16,
``int-quantized``), or int4 weights with a scale (and zero point) per group or channel
(W4A16, ``pack-quantized``); GPTQ and AWQ int4 files (``gptq_awq.py``).
``config.json``'s ``quantization_config`` says which; any other method or scheme is a
clear error at load, never a silent full-precision model.

How they load: each quantized linear's codes and scales are kept (``Grid``), its weight
is dequantized so the model's own loader fills (and fuses: q, k, v into qkv_proj) its
layers as from any checkpoint, and then every text-decoder linear whose sources were
quantized is replaced by a ``QuantLinear`` of the checkpoint's own codes, rows of fused
sources stacked in order. Activations stay in full precision: a W8A8 checkpoint runs as
W8A16 (its per-token activation quantization is not applied), a little closer to the
full-precision model than vLLM's int8 GEMM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.kernels.quant import QuantizedWeight, int4_weight, int8_weight
from services.models import gptq_awq
from services.models.checkpoint import CheckpointError
from services.models.quant_grid import SUPPORTED, Grid, Scheme, int4_grid, unpack_int32
from services.models.quantize import QuantLinear, text_decoder

# Our fused linears and the checkpoint linears whose rows they stack, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def scheme_of(hf_config) -> Scheme | None:
    """The checkpoint's quantization (None: full precision); a kind we cannot run raises."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        return gptq_awq.scheme(qc)
    if method != "compressed-tensors":
        raise CheckpointError(f"quantization method {method!r} is not supported: {SUPPORTED}")
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt not in ("int-quantized", "naive-quantized", "pack-quantized") or len(groups) != 1:
        raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported: {SUPPORTED}")
    w = groups[0].get("weights") or {}
    bits, strategy, kind = w.get("num_bits"), w.get("strategy"), w.get("type", "int")
    ok = kind == "int" and (
        (bits == 8 and strategy == "channel" and w.get("symmetric", True))
        or (bits == 4 and strategy in ("group", "channel"))
    )
    if not ok or w.get("actorder") not in (None, False, "static", "weight"):
        raise CheckpointError(f"compressed-tensors weights {w} are not supported: {SUPPORTED}")
    return Scheme(
        method=method,
        bits=bits,
        group=w.get("group_size") if strategy == "group" else None,
        symmetric=bool(w.get("symmetric", True)),
        packed=fmt == "pack-quantized",
        ignore=tuple(qc.get("ignore") or ()),
    )


def read_grids(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: Scheme
) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Grid]]:
    """(the checkpoint's tensors with each quantized linear's parts replaced by its
    dequantized ``.weight``, the Grid of each such linear by module name)."""
    plain: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in scheme.parts:
            parts.setdefault(module, {})[leaf] = tensor
        else:
            plain.append((name, tensor))
    grids: dict[str, Grid] = {}
    for module, p in parts.items():
        if not scheme.quantized(p):  # a linear kept in full precision
            plain.append((f"{module}.weight", p["weight"]))
            continue
        read = _grid if scheme.method == "compressed-tensors" else gptq_awq.grid
        grids[module] = read(module, p, scheme)
        plain.append((f"{module}.weight", grids[module].dequantize()))
    return iter(plain), grids


def _grid(module: str, p: dict[str, torch.Tensor], scheme: Scheme) -> Grid:
    scale = p["weight_scale"].float()
    try:
        if scheme.bits == 8:
            codes = p["weight"]
            if codes.dtype != torch.int8 or scale.numel() != codes.shape[0]:
                raise ValueError(f"int8 weight {tuple(codes.shape)}, scale {tuple(scale.shape)}")
            return Grid(8, codes, scale.reshape(-1), None)
        if scheme.packed:
            n, k = (int(v) for v in p["weight_shape"].tolist())
            codes = unpack_int32(p["weight_packed"], dim=1)[:, :k]
        else:
            codes = p["weight"].to(torch.int32) + 8
            n, k = codes.shape
        scale = scale.reshape(n, -1)
        zero = torch.full_like(scale, 8.0)
        if "weight_zero_point" in p and not scheme.symmetric:
            zp = p["weight_zero_point"]
            zp = unpack_int32(zp, dim=0)[:n] if scheme.packed else zp.to(torch.int32) + 8
            zero = zp.reshape(n, -1).float()
        if codes.shape != (n, k):
            raise ValueError(f"codes {tuple(codes.shape)} for a weight of {n} x {k}")
        return int4_grid(codes, scale, zero)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"quantized weights of {module} do not read: {e}") from e


def apply_grids(model: nn.Module, grids: dict[str, Grid]) -> int:
    """Replace each text-decoder linear made of quantized checkpoint linears by a
    ``QuantLinear`` of their codes; returns how many. A quantized LM head stays as loaded,
    dequantized: the greedy and sampling paths read it in full precision."""
    by_suffix = {_layer_suffix(name): name for name in grids}
    used = {name for name in grids if name.rsplit(".", 1)[-1] == "lm_head"}
    decoder, done = text_decoder(model), 0
    for name, linear in list(decoder.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(linear, nn.Linear) or leaf == "lm_head":
            continue
        head = _layer_suffix(name)[: -len(leaf)]
        sources = [by_suffix.get(head + s) for s in FUSED.get(leaf, (leaf,))]
        if all(s is None for s in sources):
            continue
        found = [grids[s] for s in sources if s is not None]
        if len(found) < len(sources) or len({g.bits for g in found}) != 1:
            raise CheckpointError(f"{name}: its checkpoint linears are not quantized alike")
        parent_name, _, attr = name.rpartition(".")
        parent = decoder.get_submodule(parent_name) if parent_name else decoder
        setattr(parent, attr, QuantLinear(_stacked(found), linear.bias))
        used.update(sources)
        done += 1
    if len(used) < len(grids):
        lost = sorted(set(grids) - used)[:4]
        raise CheckpointError(f"quantized linears with no place in the model: {lost}")
    return done


def _layer_suffix(name: str) -> str:
    """A linear's name from its layer on (``layers.3.self_attn.q_proj``): prefixes differ
    between a checkpoint and the model (``model.``, ``model.language_model.``)."""
    i = name.rfind("layers.")
    return name[i:] if i >= 0 else name


def _stacked(grids: list[Grid]) -> QuantizedWeight:
    codes = torch.cat([g.codes for g in grids])
    scale = torch.cat([g.scale for g in grids])
    if grids[0].bits == 8:
        return int8_weight(codes, scale)
    return int4_weight(codes, scale, torch.cat([g.zero for g in grids]))
