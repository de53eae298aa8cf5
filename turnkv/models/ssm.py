"""Recurrent mixers shared by the state-space families: causal depthwise conv with carried state,
Mamba 2 SSD (chunked scan + single-step), the gated delta rule (Qwen3-Next), and a diagonal
linear recurrence (RG-LRU).

Every scan takes the initial state explicitly and returns the final one, so a prefill can be cut
into chunks anywhere (or restored from a snapshot) and still produce the one-shot result.
Layouts are time-major without a batch dimension: ``x [T, ...]``. Scans run in float32 whatever
the model dtype (they accumulate products of decays), and return float32.

Conv state convention (all families): ``[K - 1, channels]``, the last ``K - 1`` conv *inputs*,
oldest first; zeros before the first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import each_row, linear
from .batch import Batch, Span, spans_apply
from .tensors import param, take


# --- causal depthwise conv ---------------------------------------------------------------------

def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [T, C]`` continuing from ``state [K-1, C]``.
    ``weight [C, K]``. Returns (out [T, C] before any activation, new state [K-1, C])."""
    K = weight.shape[1]
    xp = torch.cat([state.to(x.dtype), x], dim=0)                     # [K-1+T, C]
    out = F.conv1d(xp.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
    return out, xp[xp.shape[0] - (K - 1):]


# --- shared scan pieces ---------------------------------------------------------------------------

def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``i >= j``, ``-inf`` above the diagonal.
    Summing the masked values directly (rather than subtracting two cumsums) keeps long decays
    exact enough that exp() of it matches a sequential recurrence."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)                               # x[..., i, j] = a[i]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    s = x.masked_fill(~strict, 0).cumsum(dim=-2)
    return s.masked_fill(~strict.logical_or(torch.eye(L, dtype=torch.bool, device=a.device)), -math.inf)


def _heads(t: torch.Tensor, reps: int) -> torch.Tensor:
    """[L, G, N] grouped -> [H, L, N] per head (head h uses group h // reps)."""
    L, G, N = t.shape
    return t.permute(1, 0, 2)[:, None].expand(G, reps, L, N).reshape(G * reps, L, N)


# --- Mamba 2 SSD ------------------------------------------------------------------------------------

def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD: ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t``.

    x [T, H, P], dt [T, H] (already softplus'd), A [H] (negative), B/C [T, G, N], state [H, P, N].
    Returns (y [T, H, P] without the D skip, final state [H, P, N]); all float32."""
    x, dt, A, B, C = x.float(), dt.float(), A.float(), B.float(), C.float()
    state = state.float()
    T, H, P = x.shape
    G = B.shape[1]
    R = H // G
    y = torch.empty_like(x)
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        L = e - s
        xdt = (x[s:e] * dt[s:e, :, None]).transpose(0, 1)              # [H, L, P]
        a = (dt[s:e] * A).t()                                          # [H, L]
        cum = a.cumsum(dim=-1)
        # intra-chunk: attention-like mixing with the decay between positions
        CB = torch.einsum("lgn,sgn->gls", C[s:e], B[s:e])              # [G, L, L]
        M = (CB[:, None] * segsum(a).exp().view(G, R, L, L)).view(H, L, L)
        Ch, Bh = _heads(C[s:e], R), _heads(B[s:e], R)                  # [H, L, N]
        # inter-chunk: read the state carried in, decayed to each position
        y_off = torch.matmul(Ch, state.transpose(-1, -2)) * cum.exp()[..., None]
        y[s:e] = (torch.matmul(M, xdt) + y_off).transpose(0, 1)
        decay_to_end = (cum[:, -1:] - cum).exp()                       # [H, L]
        state = (state * cum[:, -1].exp()[:, None, None]
                 + torch.matmul((xdt * decay_to_end[..., None]).transpose(-1, -2), Bh))
    return y, state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSD recurrence. x [H, P], dt [H], A [H], B/C [G, N], state [H, P, N]."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    R = x.shape[0] // B.shape[0]
    Bh, Ch = B.repeat_interleave(R, 0), C.repeat_interleave(R, 0)      # [H, N]
    dA = torch.exp(dt * A.float())
    state = state.float() * dA[:, None, None] + (dt[:, None, None] * Bh[:, None, :]) * x[..., None]
    return torch.matmul(state, Ch[..., None])[..., 0], state


def gated_group_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """Mamba 2's gated RMSNorm (gate first, then normalise within groups): x, gate [T, D]."""
    dtype = x.dtype
    h = x.float() * each_row(F.silu, gate.float())
    T, D = h.shape
    h = h.view(T, D // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(T, D).to(dtype)


@dataclass(frozen=True)
class Mamba2Dims:
    """The Mamba 2 mixer's shape, independent of how a family's config spells it."""
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


def config_float(v) -> float:
    """A float from a config.json value; transformers 5 writes infinities as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    return float(v)


def time_step_limit(v) -> tuple[float, float]:
    """A config's ``time_step_limit`` (absent = no clamp) as two floats."""
    if not v:
        return (0.0, math.inf)
    lo, hi = v
    return (config_float(lo), config_float(hi))


def mamba2_state_fields(d: Mamba2Dims) -> dict[str, tuple[int, ...]]:
    """Named per-layer state for ``specs.recurrent(**fields)``."""
    return {"conv": (d.conv_kernel - 1, d.conv_dim), "ssm": (d.num_heads, d.head_dim, d.state_size)}


class Mamba2Mixer(nn.Module):
    """The Mamba 2 mixer (in_proj -> conv -> SSD -> gated norm -> out_proj) with transformers'
    parameter names under prefix ``p`` (``{p}.in_proj.weight``, ``{p}.conv1d.weight``, ``{p}.A_log``,
    ``{p}.D``, ``{p}.dt_bias``, ``{p}.norm.weight``, ``{p}.out_proj.weight``)."""

    def __init__(self, d: Mamba2Dims, t: dict, p: str, dtype: torch.dtype):
        super().__init__()
        self.d = d
        self.w_in = param(take(t, f"{p}.in_proj.weight"), dtype)
        self.b_in = param(take(t, f"{p}.in_proj.bias"), dtype) if d.use_bias else None
        self.w_conv = param(take(t, f"{p}.conv1d.weight").reshape(d.conv_dim, d.conv_kernel), dtype)
        self.b_conv = param(take(t, f"{p}.conv1d.bias"), dtype) if d.use_conv_bias else None
        self.dt_bias = param(take(t, f"{p}.dt_bias"), torch.float32)
        self.A = param(-torch.exp(take(t, f"{p}.A_log").float()), torch.float32)
        self.D = param(take(t, f"{p}.D"), torch.float32)
        self.w_norm = param(take(t, f"{p}.norm.weight"), dtype)
        self.w_out = param(take(t, f"{p}.out_proj.weight"), dtype)
        self.b_out = param(take(t, f"{p}.out_proj.bias"), dtype) if d.use_bias else None

    def forward(self, x: torch.Tensor, batch: Batch, i: int) -> torch.Tensor:
        """x [N, hidden] (every row of the batch); per span, reads and writes
        ``span.caches[i].state['conv'|'ssm']`` and advances that cache."""
        d = self.d
        I, GN = d.intermediate_size, d.n_groups * d.state_size
        gate, xbc, dt = linear(x, self.w_in, self.b_in).split([I, d.conv_dim, d.num_heads], dim=-1)
        dt = each_row(F.softplus, dt.float() + self.dt_bias).clamp(*d.time_step_limit)

        def one(s: Span):   # conv window and scan: this sequence's rows over its own state
            cache, T = s.caches[i], s.length
            conv, conv_state = causal_conv1d(xbc[s.rows], cache.state["conv"], self.w_conv, self.b_conv)
            cache.set("conv", conv_state)
            xs, B, C = each_row(F.silu, conv).split([I, GN, GN], dim=-1)
            xs = xs.reshape(T, d.num_heads, d.head_dim)
            B, C = B.reshape(T, d.n_groups, d.state_size), C.reshape(T, d.n_groups, d.state_size)
            if T == 1:
                y, state = ssd_step(xs[0], dt[s.start], self.A, B[0], C[0], cache.state["ssm"])
                y = y[None]
            else:
                y, state = ssd_scan(xs, dt[s.rows], self.A, B, C, cache.state["ssm"], d.chunk_size)
            cache.set("ssm", state)
            cache.advance(T)
            # contiguous as a multi-span batch's concatenation is: the norm below reduces in
            # layout order, so a sequence alone must present the same layout to round the same
            return (y + self.D[:, None] * xs.float()).contiguous()
        y = spans_apply(batch, one, i)
        y = gated_group_rms_norm(y.reshape(x.shape[0], I).to(x.dtype), gate, self.w_norm, I // d.n_groups, d.eps)
        return linear(y, self.w_out, self.b_out)


# --- gated delta rule (Qwen3-Next) -------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule. Per head: ``S <- exp(g_t) S``; ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``;
    ``o_t = S^T q_t``.

    q, k [H, T, Dk] (already normalised/scaled, one per value head), v [H, T, Dv], g (log decay) and
    beta [H, T], state [H, Dk, Dv]. Returns (o [H, T, Dv], final state); float32."""
    q, k, v, g, beta, state = (t.float() for t in (q, k, v, g, beta, state))
    H, T, _ = q.shape
    out = torch.empty_like(v)
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        L = e - s
        qc, kc, vc = q[:, s:e], k[:, s:e], v[:, s:e]
        cum = g[:, s:e].cumsum(dim=-1)                                 # [H, L]
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, -math.inf).exp()
        kb = kc * beta[:, s:e, None]
        # UT transform: the chunk's L sequential delta updates as one unit-lower-triangular solve
        ut = torch.matmul(kb, kc.transpose(-1, -2)) * decay
        u = torch.linalg.solve_triangular(ut, vc * beta[:, s:e, None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(ut, kb * cum.exp()[..., None], upper=False, unitriangular=True)
        v_new = u - torch.matmul(w, state)                             # [H, L, Dv]
        attn = torch.matmul(qc, kc.transpose(-1, -2)) * decay
        out[:, s:e] = torch.matmul(qc * cum.exp()[..., None], state) + torch.matmul(attn, v_new)
        k_to_end = kc * (cum[:, -1:] - cum).exp()[..., None]
        state = state * cum[:, -1].exp()[:, None, None] + torch.matmul(k_to_end.transpose(-1, -2), v_new)
    return out, state


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule. q, k [H, Dk], v [H, Dv], g, beta [H], state [H, Dk, Dv]."""
    q, k, v, g, beta, state = (t.float() for t in (q, k, v, g, beta, state))
    state = state * g.exp()[:, None, None]
    mem = (state * k[..., None]).sum(dim=-2)                           # [H, Dv]
    delta = (v - mem) * beta[:, None]
    state = state + k[..., None] * delta[:, None, :]
    return (state * q[..., None]).sum(dim=-2), state


# --- diagonal linear recurrence (RG-LRU) ---------------------------------------------------------------

def linear_recurrence(log_a: torch.Tensor, x: torch.Tensor, h: torch.Tensor,
                      chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``h_t = exp(log_a_t) * h_{t-1} + x_t`` elementwise. log_a, x [T, W]; h [W].
    Returns (all h_t [T, W], final h [W]); float32. Chunked: within a chunk the recurrence is a
    [L, L] lower-triangular decay matrix per channel (a small L keeps that [W, L, L] cheap)."""
    log_a, x, h = log_a.float(), x.float(), h.float()
    T = x.shape[0]
    if T == 1:
        h = log_a[0].exp() * h + x[0]
        return h[None], h
    out = torch.empty_like(x)
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        la = log_a[s:e].t()                                            # [W, L]
        y = torch.matmul(segsum(la).exp(), x[s:e].t()[..., None])[..., 0]  # [W, L]
        y = y + la.cumsum(dim=-1).exp() * h[:, None]
        out[s:e] = y.t()
        h = y[:, -1]
    return out, h
