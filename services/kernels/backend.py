"""The op interface every layer calls; the torch backend serves on CPU, Triton on CUDA.

Every op listed here goes through a backend: models never call a kernel directly, so a
flag (``--attention-backend``) or the device picks the implementation for all of them.
Contracts (shapes, dtypes, in-place-ness) are those of the torch reference in
``services/kernels/torch_backend.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.kernels.metadata import AttentionMetadata, DecoderStack, SamplingTensors


class Backend(Protocol):
    name: str
    # Most rows ``decode_stack`` runs in one call (0: none). Up to this many, a
    # verification goes in as one-token rows (``services/engine/step_meta.py``).
    stack_max_rows: int

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Scatter the new K/V rows into their cache slots (negative slot: skip the row)."""

    def attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D], query's dtype
        """Causal paged attention over cached prefix + new tokens; GQA when Hq > Hkv."""

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None = None,  # [T, H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm in fp32. With residual: returns (norm(x + residual), x + residual)."""

    def rotary(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] fp32: cos in the first half, sin in the second
        is_neox: bool,
    ) -> None:
        """Rotate the first rot_dim features of query and key in place."""

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [B, V] fp32 (penalties applied) -> sampled token ids [B] int64."""

    def linear(
        self,
        x: torch.Tensor,  # [T, K]
        weight: torch.Tensor,  # [N, K], any strides
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        """x @ weight.T + bias, as ``F.linear``."""

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] = (gate | up) -> silu(gate) * up [T, I]."""

    def greedy_head(
        self,
        x: torch.Tensor,  # [T, K], hidden states
        weight: torch.Tensor,  # [V, K], the LM head
    ) -> torch.Tensor:  # [T] int64
        """argmax(x @ weight.T) per row, the first index on ties: what ``linear`` then
        ``sample`` give for greedy rows, for a step that needs nothing else of the logits."""

    def decode_stack(
        self,
        stack: DecoderStack,
        positions: torch.Tensor,  # [B] int64
        hidden: torch.Tensor,  # [B, H], the embeddings of the B new tokens
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,  # B sequences, one new token each
        aux_layers: tuple[int, ...] = (),  # layers whose outputs to return too
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """A whole decode step: the final-normed hidden states [B, H] with every layer's
        K/V written, or None when this backend has no such path for these inputs (the
        model then runs its layers op by op; the results must agree). With
        ``aux_layers``: (hidden, aux [B, len(aux_layers) * H]), aux as
        ``DecoderModel.forward`` returns it. Several of the B rows may be one sequence's
        (a verification, see ``services/engine/step_meta.py``)."""

    def decode_greedy(
        self,
        stack: DecoderStack,
        embed: torch.Tensor,  # [V, H], the embedding table
        head: torch.Tensor,  # [V, H], the LM head
        tokens: torch.Tensor,  # [B] int64, the last known token of each sequence
        positions: torch.Tensor,  # [B] int64, their positions
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,  # step 0: B sequences, one new token each
        steps: int,
    ) -> torch.Tensor | None:  # [steps, B] int64
        """``steps`` greedy decode steps at once: step s feeds the token step s - 1 chose
        (``tokens`` first) at ``positions + s``, its K/V going to the slot the block
        tables give (they cover ``positions + steps - 1``). The tokens chosen, exactly
        those of ``steps`` rounds of embed, ``decode_stack`` and ``greedy_head``; None when
        this backend has no such path (the caller then runs those rounds)."""


def get_backend(
    name: str,
    device: torch.device,
    kernel_cache_dir: str = "",
    kernel_cc: str = "cc",
    **cpu_options,
) -> Backend:
    """``auto`` picks Triton on CUDA, else the native CPU kernels when they build here, else
    torch; ``cpu`` insists on the native kernels (``cpu_options``: theirs, e.g.
    ``greedy_head_screen`` and ``packed_weights_mb``, see EngineConfig)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu":
            from services.kernels.cpu_backend import CpuBackend

            backend = CpuBackend.create(kernel_cache_dir, kernel_cc, **cpu_options)
            if backend is not None:
                return backend
            name = "torch"
    if name == "cpu":
        from services.kernels.cpu_backend import CpuBackend

        if device.type != "cpu":
            raise ValueError("attention backend 'cpu' serves only device cpu")
        backend = CpuBackend.create(kernel_cache_dir, kernel_cc, **cpu_options)
        if backend is None:
            raise ValueError("attention backend 'cpu' is unavailable: its kernels did not build")
        return backend
    if name == "torch":
        from services.kernels.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        try:
            from services.kernels.triton_backend import TritonBackend
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ValueError(f"attention backend 'triton' is unavailable: {e}") from e
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected auto, cpu, torch or triton)")
