"""The grouped-GEMM MoE kernel (Triton, interpreted without CUDA) against its torch
twin and against plain per-pair products; and an MoE layer on the Triton backend against
the same layer on the torch backend."""

from __future__ import annotations

import pytest
import torch

from services.kernels import torch_backend as ref
from services.kernels.torch_backend import TorchBackend
from services.kernels.triton_backend import TritonBackend
from services.kernels.triton_moe import BLOCK_M, align_by_expert, grouped_gemm

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("column_major", [False, True])
def test_grouped_gemm_is_its_twin_and_the_plain_products(column_major):
    g = torch.Generator().manual_seed(0)
    tokens, k, n, experts, top = 11, 40, 48, 5, 2
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(experts, n, k, generator=g)
    if column_major:  # as the CPU path keeps experts: strides (1, n) per matrix
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    picks = torch.stack([torch.randperm(experts, generator=g)[:top] for _ in range(tokens)])
    picks[picks == 3] = 4  # expert 3 unused: an empty group
    rows, blocks, pairs = align_by_expert(picks, experts)
    assert rows.numel() % BLOCK_M == 0 and blocks.numel() == rows.numel() // BLOCK_M
    got = grouped_gemm(x, w, rows, blocks)
    torch.testing.assert_close(got, ref.grouped_gemm(x, w, rows, blocks), rtol=1e-5, atol=1e-5)
    flat = picks.flatten()
    for slot in torch.nonzero(pairs >= 0).flatten().tolist():
        p = int(pairs[slot])
        want = x[p // top] @ w[flat[p]].t()
        torch.testing.assert_close(got[slot], want, rtol=1e-5, atol=1e-5)
    assert (got[pairs < 0] == 0).all()


def test_an_moe_layer_on_the_triton_backend_is_the_torch_one():
    from transformers import MixtralConfig

    from services.models.moe import MoEMLP

    cfg = MixtralConfig(hidden_size=32, num_local_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    layers = [MoEMLP(cfg, be, 6, 24, True) for be in (TorchBackend(), TritonBackend())]
    for p in layers[0].parameters():
        p.data.normal_(0, 0.3)
    layers[1].load_state_dict(layers[0].state_dict())
    h = torch.randn(9, 32)
    with torch.no_grad():
        torch.testing.assert_close(layers[1](h), layers[0](h), rtol=1e-5, atol=1e-5)
