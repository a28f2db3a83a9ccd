"""The Mamba-2 mixer on a per-request recurrent state (Nemotron-H's Mamba layers).

A request holds, per Mamba layer, a slot of two tensors: the last ``conv_kernel - 1``
inputs of the causal depthwise convolution ([conv_dim, K - 1]) and the SSM state
([heads, head_dim, state_size], fp32). The engine's state pool owns them
(services/engine/mamba_state.py); a step names each sequence's slot.

A sequence with one new token (decode) takes one recurrent step; all of a step's decode
rows go together. A longer query (a prefill chunk) runs the chunked scan of the state
space duality: within a chunk of ``chunk_size`` tokens the outputs are one masked
matrix product, and the state carries from chunk to chunk, starting from the slot's
state, so a prompt prefilled in several engine chunks continues where the last stopped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.kernels.backend import Backend


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend = backend
        self.heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.state_size, self.groups = cfg.ssm_state_size, cfg.n_groups
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.kernel = cfg.conv_kernel
        self.chunk = cfg.chunk_size
        self.eps = cfg.layer_norm_epsilon
        self.dt_min, self.dt_max = (float(v) for v in cfg.time_step_limit)
        if self.heads % self.groups or self.inner % self.groups:
            raise ValueError(f"{self.heads} Mamba heads do not split into {self.groups} groups")
        bias = bool(cfg.use_bias)
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=cfg.use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv state, SSM state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.head_dim, self.state_size)

    def forward(self, h, state, qlens: list[int], slots: torch.Tensor) -> torch.Tensor:
        """``h`` [T, hidden], the packed rows of sequences of ``qlens`` tokens whose
        slots in ``state`` = (conv [S, ...], ssm [S, ...]) are ``slots`` [num_seqs]."""
        proj = self.backend.linear(h, self.in_proj.weight, self.in_proj.bias)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = torch.empty(h.shape[0], self.inner, dtype=torch.float32, device=h.device)
        if all(q == 1 for q in qlens):  # a decode step: every row in one recurrent step
            y.copy_(self._steps(xbc, dt, state, slots))
        else:
            starts = [0]
            for q in qlens:
                starts.append(starts[-1] + q)
            single = [i for i, q in enumerate(qlens) if q == 1]
            if single:
                rows = torch.tensor([starts[i] for i in single], device=h.device)
                y[rows] = self._steps(xbc[rows], dt[rows], state, slots[single])
            for i, q in enumerate(qlens):
                if q > 1:
                    s, e = starts[i], starts[i + 1]
                    y[s:e] = self._chunk(xbc[s:e], dt[s:e], state, slots[i : i + 1])
        out = self._gated_norm(y, gate)
        return self.backend.linear(out.to(h.dtype), self.out_proj.weight, self.out_proj.bias)

    def _split(self, xbc: torch.Tensor):
        """The convolved rows as x [n, heads, head_dim] and B, C [n, heads, state]
        (each group's B and C shared by its heads)."""
        n, g = xbc.shape[0], self.groups
        x, b, c = xbc.split([self.inner, g * self.state_size, g * self.state_size], dim=-1)
        rep = self.heads // g
        b = b.reshape(n, g, self.state_size).repeat_interleave(rep, dim=1)
        c = c.reshape(n, g, self.state_size).repeat_interleave(rep, dim=1)
        return x.reshape(n, self.heads, self.head_dim), b, c

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt.clamp(self.dt_min, self.dt_max)

    def _steps(self, xbc, dt, state, slots: torch.Tensor) -> torch.Tensor:
        """One recurrent step of each row (one sequence each): [n, inner] fp32."""
        conv_all, ssm_all = state
        window = torch.cat([conv_all[slots], xbc.unsqueeze(-1).to(conv_all.dtype)], dim=-1)
        conv_all[slots] = window[..., 1:]
        w = self.conv1d.weight
        out = F.conv1d(window.to(w.dtype), w, self.conv1d.bias, groups=self.conv_dim)
        x, b, c = self._split(F.silu(out.squeeze(-1)).float())
        dt = self._dt(dt)  # [n, heads]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))
        n, h = x.shape[:2]
        # state * decay + x (dt b)^T, in place: the state is the largest thing a step
        # touches (heads x head_dim x state_size a layer), so it is passed over twice,
        # not copied into temporaries. One sequence updates its slot where it lies.
        s = ssm_all[int(slots[0])].unsqueeze(0) if n == 1 else ssm_all.index_select(0, slots)
        s.mul_(decay[..., None, None])
        flat = s.view(n * h, self.head_dim, self.state_size)
        flat.baddbmm_(x.reshape(n * h, -1, 1), (dt[..., None] * b).reshape(n * h, 1, -1))
        if n > 1:
            ssm_all.index_copy_(0, slots, s)
        y = torch.bmm(flat, c.reshape(n * h, -1, 1)).view(n, h, -1)
        y = y + x * self.D.float()[:, None]
        return y.reshape(n, self.inner)

    def _chunk(self, xbc, dt, state, slot: torch.Tensor) -> torch.Tensor:
        """One sequence's query of several tokens, from the slot's state: [q, inner]."""
        conv_all, ssm_all = state
        q = xbc.shape[0]
        seq = torch.cat([conv_all[slot][0], xbc.t().to(conv_all.dtype)], dim=-1)
        conv_all[slot] = seq[:, -(self.kernel - 1) :].unsqueeze(0)
        w = self.conv1d.weight
        out = F.conv1d(seq.unsqueeze(0).to(w.dtype), w, self.conv1d.bias, groups=self.conv_dim)
        x, b, c = self._split(F.silu(out[0, :, -q:].t()).float())
        y, final = ssd_scan(
            x, self._dt(dt), -torch.exp(self.A_log.float()), b, c, ssm_all[slot][0], self.chunk
        )
        ssm_all[slot] = final.unsqueeze(0).to(ssm_all.dtype)
        y = y + x * self.D.float()[:, None]
        return y.reshape(q, self.inner)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per group of ``inner / groups`` channels of y * silu(gate), in fp32."""
        y = y * F.silu(gate.float())
        grouped = y.view(y.shape[0], self.groups, -1)
        var = grouped.pow(2).mean(-1, keepdim=True)
        y = (grouped * torch.rsqrt(var + self.eps)).view_as(y)
        return self.norm.weight.float() * y


def ssd_scan(x, dt, a, b, c, state, chunk: int):
    """The selective scan of one sequence, ``chunk`` tokens at a time.

    x [L, h, p], dt [L, h] (discretised), a [h] (negative), b / c [L, h, n], state
    [h, p, n]: the state before the first token. Returns (y [L, h, p] without the D
    skip, the state after the last token). Within a chunk, token t reads token s <= t
    through exp(sum of dt*a over s+1..t) (c_t . b_s) dt_s x_s, and the incoming state
    through exp(sum over 1..t) c_t . state.
    """
    ys = []
    xdt = x * dt[..., None]
    for start in range(0, x.shape[0], chunk):
        part = slice(start, start + chunk)
        cum = torch.cumsum(dt[part] * a, dim=0)  # [l, h]: log decay from the chunk's start
        n = cum.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        gaps = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], float("-inf"))
        scores = torch.einsum("thn,shn->tsh", c[part], b[part]) * torch.exp(gaps)
        y = torch.einsum("tsh,shp->thp", scores, xdt[part])
        y = y + torch.einsum("thn,hpn->thp", c[part], state) * torch.exp(cum)[..., None]
        to_end = torch.exp(cum[-1] - cum)  # [l, h]: decay from each token to the chunk's end
        added = torch.einsum("sh,shn,shp->hpn", to_end, b[part], xdt[part])
        state = state * torch.exp(cum[-1])[:, None, None] + added
        ys.append(y)
    return torch.cat(ys), state
