"""GPTQ and AWQ int4 checkpoints, read as they are published.

Both store a linear as ``qweight`` (int32 words of eight 4-bit codes), ``qzeros`` (zero
points packed the same way), ``scales`` (fp16, [groups, out]) and, for GPTQ, ``g_idx``
(each input row's group). A weight is ``(code - zero) * scale``, the arithmetic our int4
kernels run (services/kernels/quant.py), so the codes load unchanged:

- GPTQ: ``qweight`` [in / 8, out] packs along the inputs (row 8r + i at bits 4i of word
  r), ``qzeros`` [groups, out / 8] along the outputs. Files of ``checkpoint_format``
  ``gptq`` (v1, the default) store each zero point minus one; ``gptq_v2`` stores it as
  it is. Act-order (``desc_act``: groups in a permuted input order) is refused.
- AWQ (``version: gemm``): ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] pack
  along the outputs in the interleaved order of its GEMM kernel: bits 4i of a word hold
  column ``8c + ORDER[i]``. The GEMV layout and zero-point-free files are refused.
"""

from __future__ import annotations

import torch

from services.models.checkpoint import CheckpointError
from services.models.quant_grid import SUPPORTED, Grid, Scheme, int4_grid, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column m of a group of eight sits in nibble AWQ_COLUMN[m] (the inverse of AWQ_ORDER)
AWQ_COLUMN = tuple(AWQ_ORDER.index(m) for m in range(8))


def scheme(qc: dict) -> Scheme:
    """The Scheme of a GPTQ or AWQ ``quantization_config``; what we cannot run raises."""
    method = qc["quant_method"]
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    if bits != 4 or not isinstance(group, int) or group == 0 or group < -1:
        raise CheckpointError(f"{method} with bits={bits}, group_size={group}: {SUPPORTED}")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if qc.get("desc_act") or fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(
                f"GPTQ with desc_act={qc.get('desc_act')}, checkpoint_format={fmt!r}: {SUPPORTED}"
            )
        zero_offset = 1 if fmt == "gptq" else 0
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or not qc.get("zero_point", True):
            raise CheckpointError(
                f"AWQ version={version!r}, zero_point={qc.get('zero_point')}: {SUPPORTED}"
            )
        zero_offset = 0
    return Scheme(
        method=method,
        bits=4,
        group=None if group == -1 else group,
        symmetric=bool(qc.get("sym", False)),
        packed=True,
        zero_offset=zero_offset,
    )


def grid(module: str, p: dict[str, torch.Tensor], s: Scheme) -> Grid:
    """One linear's codes [out, in], scales and zero points [out, groups]."""
    try:
        scale = p["scales"].float()
        if s.method == "gptq":
            codes = unpack_int32(p["qweight"], dim=0).t()
            zero = unpack_int32(p["qzeros"], dim=1)
            _check_groups(p.get("g_idx"), codes.shape[1], scale.shape[0])
        else:
            codes = _awq_columns(unpack_int32(p["qweight"], dim=1)).t()
            zero = _awq_columns(unpack_int32(p["qzeros"], dim=1))
        zero = zero[:, : codes.shape[0]] + s.zero_offset
        return int4_grid(codes.contiguous(), scale.t().contiguous(), zero.t().contiguous())
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"quantized weights of {module} do not read: {e}") from e


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """[rows, out] values in AWQ's packed order -> in column order."""
    rows, cols = unpacked.shape
    return unpacked.reshape(rows, cols // 8, 8)[:, :, list(AWQ_COLUMN)].reshape(rows, cols)


def _check_groups(g_idx: torch.Tensor | None, k: int, groups: int) -> None:
    """GPTQ's g_idx must be the plain order (input row i in group i // (k / groups))."""
    if k % groups:
        raise ValueError(f"{k} inputs do not split into {groups} groups")
    if g_idx is None:
        return
    plain = torch.arange(k, dtype=torch.int64) // (k // groups)
    if g_idx.numel() != k or not torch.equal(g_idx.to(torch.int64), plain):
        raise ValueError("act-order groups (a g_idx not in input order) are not supported")
