"""Kimi Linear: Kimi Delta Attention (KDA: a gated delta rule whose decay is per key channel, not per
head, after a short causal conv over q|k|v) on most layers, Multi-head Latent Attention (MLA,
NoPE) on the others, a DeepSeek-style MoE (sigmoid router with a score-correction bias, group-limited
top-k, renormalised and scaled, plus shared experts) on every layer after the first dense ones.

State per layer (``cache_specs()``):

* KDA layers: ``recurrent(conv, recurrent)``, the existing recurrent state kind (cache/recurrent.py):
  ``conv [K-1, 3 * heads * head_dim]`` (the last inputs of the conv) and ``recurrent [heads,
  head_dim, head_dim]``, held in float32 under any compute dtype (``state_dtype``). A summary of every token: restorable only to its own length, so the
  family gets message-boundary checkpoints from the policy.
* MLA layers: ``full``, holding the compressed latent ``[kv_a_layernorm(c_kv) | k_rope]`` (one
  head of ``kv_lora_rank + qk_rope_head_dim`` channels, split in halves as the store's K and V)
  rather than per-head K/V. Attention runs absorbed: ``kv_b_proj``'s key half is folded into the
  queries and its value half applied after attention, so no step re-expands the cached latents
  (transformers expands them every step; same result up to float rounding). Any ``t <= length``
  restores exactly (full attention).

Weights load under the names save_pretrained and the released checkpoints use
(``block_sparse_moe.experts.{e}.w1/w2/w3``, ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``,
``self_attn.f_a_proj`` ...) or transformers' in-memory names (``mlp.experts.gate_up_proj``,
``self_attn.conv1d``, ``self_attn.forget_gate.*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..cache.kv import KVView
from .base import Model, attention, each_row, embedding, linear, rms_norm, rowwise_linear, sigmoid_each
from .batch import Batch, Span, spans_apply
from .decoder import DecoderArgs, GatedMLP, HybridBlock, decoder_weights
from .experts import RoutedExperts, expert_stacks
from .ssm import causal_conv1d
from .tensors import MissingWeight, as_float, fused_weight, param, stored, take, weight

LINEAR, FULL = "linear_attention", "full_attention"
KDA_CHUNK = 64


# transformers builds MLA's q_a / kv_a RMSNorms with their class default eps, not the config's
# rms_norm_eps (1e-5 in Kimi Linear's released config)
LATENT_NORM_EPS = 1e-6


def first_set(*values, default=None):
    """The first of ``values`` that is not None, else ``default`` (a setting a config may spell two ways)."""
    return next((x for x in values if x is not None), default)


@dataclass(kw_only=True)
class LatentMoEArgs(DecoderArgs):
    """The config fields Kimi Linear and Bailing hybrid (models/bailing_hybrid.py) share: MLA's
    latent sizes, the DeepSeek-style MoE's settings and the per-layer type lists."""

    computes = {"hidden_act": ("silu",)}

    moe_intermediate_size: int = 1024
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    attention_bias: bool = False
    hidden_act: str = "silu"
    routed_scaling_factor: float = 2.446
    # the MoE settings under transformers' attribute names and under the names config.json uses
    num_local_experts: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    num_experts_per_token: int | None = None
    n_shared_experts: int | None = None
    num_shared_experts: int | None = None
    n_group: int | None = None
    num_expert_group: int | None = None
    topk_group: int | None = 1
    norm_topk_prob: bool | None = None
    moe_renormalize: bool | None = None
    first_k_dense_replace: int = 1
    mlp_layer_types: list | None = None
    layer_types: list | None = None

    def resolve_moe(self, family: str, experts: int, groups: int, topk_group: int) -> None:
        """The names MoE reads (``experts``, ``top_k``, ``shared``, ``groups``, ``topk_group``,
        ``renormalize``) from whichever spelling the config used, else the family's defaults; the
        dense-then-sparse MLP pattern unless the config lists one."""
        self.experts = first_set(self.num_local_experts, self.num_experts, default=experts)
        self.top_k = first_set(self.num_experts_per_tok, self.num_experts_per_token, default=8)
        self.shared = first_set(self.n_shared_experts, self.num_shared_experts, default=1)
        self.groups = first_set(self.n_group, self.num_expert_group, default=groups)
        self.topk_group = first_set(self.topk_group, default=topk_group)
        self.renormalize = first_set(self.norm_topk_prob, self.moe_renormalize, default=True)
        # transformers ties neither family's lm_head (their _tied_weights_keys are empty): a stored
        # head is used whatever tie_word_embeddings says; the embedding serves only a file without one
        self.tie_word_embeddings = False
        if not self.mlp_layer_types:
            n = self.num_hidden_layers
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]


@dataclass(kw_only=True)
class ModelArgs(LatentMoEArgs):
    linear_attn_config: dict | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        super().__post_init__()
        self.resolve_moe("Kimi Linear", experts=256, groups=1, topk_group=1)
        lac = self.linear_attn_config or {}
        self.linear_head_dim = lac.get("head_dim", self.linear_head_dim)
        self.linear_num_heads = lac.get("num_heads", self.linear_num_heads)
        self.linear_conv_kernel_dim = lac.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
        n = self.num_hidden_layers
        if not self.layer_types:
            if "full_attn_layers" in lac and "kda_layers" in lac:   # 1-based in the released config
                self.layer_types = [None] * n
                for i in lac["full_attn_layers"]:
                    self.layer_types[i - 1] = FULL
                for i in lac["kda_layers"]:
                    self.layer_types[i - 1] = LINEAR
            else:
                self.layer_types = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]


def _first(t: dict, *names: str) -> torch.Tensor:
    for n in names:
        if n in t:
            return t[n]
    raise MissingWeight(f"checkpoint has none of {names}")


# --- Kimi Delta Attention ---------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As transformers' (and FLA's) KDA: ``x / sqrt(sum(x^2) + eps)``."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_chunked(q, k, v, g, beta, state, chunk: int = KDA_CHUNK):
    """The gated delta rule with a per-channel decay, chunked. Per head: ``S <- diag(exp(g_t)) S``;
    ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = S^T q_t``.

    q, k [H, T, Dk] (normalised, q scaled), v [H, T, Dv], g [H, T, Dk] (log decay), beta [H, T],
    state [H, Dk, Dv]; float32. Within a chunk the decay between positions i >= j is
    ``exp(cum_i - cum_j)`` per channel (formed explicitly, never as exp(cum) * exp(-cum), which
    would overflow on strong decays) and the chunk's sequential updates are one unit-lower-
    triangular solve. Returns (o [H, T, Dv], final state)."""
    H, T, Dk = q.shape
    state = state.float()
    out = torch.empty(H, T, v.shape[-1], dtype=torch.float32, device=q.device)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        L = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e, None]
        cum = g[:, s:e].cumsum(dim=1)                                          # [H, L, Dk]
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
        qk = (qc[:, :, None, :] * kc[:, None, :, :] * diff).sum(-1)            # [H, L, L], i >= j
        kk = (kc[:, :, None, :] * kc[:, None, :, :] * diff).sum(-1).tril(-1) * bc
        system = kk + torch.eye(L, device=q.device)
        gamma = cum.exp()                                                      # decay from the chunk start
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kc * gamma * bc, upper=False, unitriangular=True)
        u = u - torch.matmul(w, state)                                         # [H, L, Dv]
        out[:, s:e] = torch.matmul(qc * gamma, state) + torch.matmul(qk, u)
        to_end = (cum[:, -1:] - cum).exp()                                     # [H, L, Dk]
        state = state * gamma[:, -1, :, None] + torch.matmul((kc * to_end).transpose(-1, -2), u)
    return out, state


def kda_step(q, k, v, g, beta, state):
    """One token: q, k, g [H, Dk], v [H, Dv], beta [H], state [H, Dk, Dv]."""
    state = state.float() * g.exp()[..., None]
    mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - mem) * beta[:, None]
    state = state + k[..., None] * delta[:, None, :]
    return (state * q[..., None]).sum(dim=-2), state


class DeltaAttention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.h, self.d = a.linear_num_heads, a.linear_head_dim
        self.dim = self.h * self.d
        self.kernel = a.linear_conv_kernel_dim
        self.eps = a.rms_norm_eps
        w = lambda name: take(t, f"{p}.{name}.weight")   # noqa: E731
        s = lambda name: stored(t, f"{p}.{name}.weight")   # noqa: E731
        # one matmul: q | k | v | forget-gate down | beta | output-gate down
        self.w_in = fused_weight([s("q_proj"), s("k_proj"), s("v_proj"),
                                  _first(t, f"{p}.f_a_proj.weight", f"{p}.forget_gate.f_a_proj.weight"),
                                  s("b_proj"), s("g_a_proj")], dtype)
        self.w_f_b = weight(_first(t, f"{p}.f_b_proj.weight", f"{p}.forget_gate.f_b_proj.weight"), dtype)
        self.w_g_b = weight(s("g_b_proj"), dtype)
        if f"{p}.conv1d.weight" in t:
            conv = take(t, f"{p}.conv1d.weight")
        else:
            conv = torch.cat([w("q_conv1d"), w("k_conv1d"), w("v_conv1d")])
        self.w_conv = param(conv.reshape(3 * self.dim, self.kernel), dtype)
        self.dt_bias = param(as_float(_first(t, f"{p}.dt_bias", f"{p}.forget_gate.dt_bias")), torch.float32)
        if f"{p}.neg_exp_A_log" in t:   # llama.cpp's GGUF holds -exp(A_log) itself (ssm_a)
            neg_a = take(t, f"{p}.neg_exp_A_log").float()
        else:
            neg_a = -as_float(_first(t, f"{p}.A_log", f"{p}.forget_gate.A_log")).float().exp()
        self.neg_A = param(neg_a.reshape(self.h, 1), torch.float32)
        self.w_norm = param(w("o_norm"), dtype)
        self.w_out = weight(s("o_proj"), dtype)

    def state_fields(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, 3 * self.dim), "recurrent": (self.h, self.d, self.d)}

    def forward(self, x, batch: Batch, i: int):
        N, H, D = x.shape[0], self.h, self.d
        qkv_all, f_a, b, g_a = linear(x, self.w_in).split([3 * self.dim, D, H, D], dim=-1)
        f = (linear(f_a, self.w_f_b).float() + self.dt_bias).view(N, H, D)
        # softplus as transformers writes it (identity above 20), times -exp(A_log) per head
        g_all = (self.neg_A * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))).transpose(0, 1)  # [H, N, D]
        beta_all = each_row(torch.sigmoid, b.float()).t()                                                          # [H, N]

        def one(s: Span):   # conv window and delta rule: this sequence's rows over its own state
            cache, T = s.caches[i], s.length
            qkv, conv_state = causal_conv1d(qkv_all[s.rows], cache.state["conv"], self.w_conv, None)
            cache.set("conv", conv_state)
            q, k, v = each_row(F.silu, qkv).float().view(T, 3, H, D).permute(1, 2, 0, 3)   # each [H, T, D]
            q, k = l2norm(q) * D ** -0.5, l2norm(k)
            g, beta, state = g_all[:, s.rows], beta_all[:, s.rows], cache.state["recurrent"]
            if T == 1:
                o, state = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
                o = o[:, None]
            else:
                o, state = kda_chunked(q, k, v, g, beta, state)
            cache.set("recurrent", state)
            cache.advance(T)
            return o.transpose(0, 1).contiguous()                                 # [T, H, D]
        o = spans_apply(batch, one, i)
        gate = linear(g_a, self.w_g_b).view(N, H, D)
        # gated RMSNorm in float32: norm(o) * w * sigmoid(gate)
        o = rms_norm(o, self.w_norm.float(), self.eps) * each_row(torch.sigmoid, gate.float())
        return linear(o.to(x.dtype).reshape(N, self.dim), self.w_out)


# --- Multi-head Latent Attention ------------------------------------------------------------------------

class LatentAttention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.h, self.R, self.r = a.num_attention_heads, a.kv_lora_rank, a.qk_rope_head_dim
        self.nope, self.dv = a.qk_nope_head_dim, a.v_head_dim
        self.dqk = self.nope + self.r
        self.scale = self.dqk ** -0.5
        self.eps = LATENT_NORM_EPS
        self.half = -(-(self.R + self.r) // 2)          # the latent, split in two as the store's K and V
        bias = a.attention_bias
        self.q_lora = a.q_lora_rank is not None
        if self.q_lora:
            self.w_q_a = weight(stored(t, f"{p}.q_a_proj.weight"), dtype)
            self.b_q_a = param(take(t, f"{p}.q_a_proj.bias"), dtype) if bias else None
            self.ln_q_a = param(take(t, f"{p}.q_a_layernorm.weight"), dtype)
            self.w_q_b = weight(stored(t, f"{p}.q_b_proj.weight"), dtype)
        else:
            self.wq = weight(stored(t, f"{p}.q_proj.weight"), dtype)
        self.w_kv_a = weight(stored(t, f"{p}.kv_a_proj_with_mqa.weight"), dtype)
        self.b_kv_a = param(take(t, f"{p}.kv_a_proj_with_mqa.bias"), dtype) if bias else None
        self.ln_kv_a = param(take(t, f"{p}.kv_a_layernorm.weight"), dtype)
        # kv_b_proj per head, split: k_b [H, nope, R] (absorbed into the queries), v_b [H, dv, R]
        # (applied to the attention output over the latent)
        kv_b = take(t, f"{p}.kv_b_proj.weight").view(self.h, self.nope + self.dv, self.R)
        self.k_b, self.v_b = param(kv_b[:, :self.nope], dtype), param(kv_b[:, self.nope:], dtype)
        self.wo = weight(stored(t, f"{p}.o_proj.weight"), dtype)
        self.bo = param(take(t, f"{p}.o_proj.bias"), dtype) if bias else None

    def cache_dims(self) -> tuple[int, int]:
        return 1, self.half

    def forward(self, x, batch: Batch, i: int):
        N, H = x.shape[0], self.h
        if self.q_lora:
            q = linear(rms_norm(linear(x, self.w_q_a, self.b_q_a), self.ln_q_a, self.eps), self.w_q_b)
        else:
            q = linear(x, self.wq)
        q = q.view(N, H, self.dqk).transpose(0, 1)                              # [H, N, dqk]
        c, k_rot = linear(x, self.w_kv_a, self.b_kv_a).split([self.R, self.r], dim=-1)
        latent = torch.cat([rms_norm(c, self.ln_kv_a, self.eps), k_rot], dim=-1)
        if latent.shape[-1] < 2 * self.half:
            latent = F.pad(latent, (0, 2 * self.half - latent.shape[-1]))
        latent = latent.view(N, 2, self.half)
        # absorbed MLA: q_nope . (k_b c) == (k_b^T q_nope) . c, so every head attends over the latent
        # itself (one shared K/V head of 2 * half channels: [c | k_rope | pad]) with the query
        # [k_b^T q_nope | q_rope | 0]; the output over the latent's c part goes through v_b per head.
        # No per-step expansion of the whole cached latent (a decode step costs S * (R + r) per head).
        q_abs = torch.cat([torch.matmul(q[..., :self.nope], self.k_b), q[..., self.nope:]], dim=-1)
        if q_abs.shape[-1] < 2 * self.half:
            q_abs = F.pad(q_abs, (0, 2 * self.half - q_abs.shape[-1]))

        def one(s: Span):
            lat = latent[s.rows]
            view = s.caches[i].update_and_fetch(lat[None, :, 0], lat[None, :, 1])
            held = torch.cat([view.keys, view.values], dim=-1)                   # [1, S, 2 * half]
            full = KVView(held, held, view.key_pos0, view.query_pos0, view.queries, view.kind, view.span,
                          view.needed_from_many)
            o = attention(q_abs[:, s.rows], full, self.scale).view(s.length, H, 2 * self.half)[..., :self.R]
            return torch.matmul(o.transpose(0, 1), self.v_b.transpose(1, 2)).transpose(0, 1).reshape(s.length, -1)
        return linear(spans_apply(batch, one), self.wo, self.bo)


# --- feed-forward ------------------------------------------------------------------------------------------


class MoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.E, self.top_k, self.groups, self.topk_group = a.experts, a.top_k, a.groups, a.topk_group
        self.renormalize, self.scaling = a.renormalize, a.routed_scaling_factor
        self.w_router = param(take(t, f"{p}.gate.weight"), torch.float32)      # float32, as transformers keeps it
        bias = t.get(f"{p}.gate.e_score_correction_bias")
        self.score_bias = param(bias if bias is not None else torch.zeros(self.E), torch.float32)
        # the released files name the experts' projections w1 (gate), w3 (up), w2 (down)
        self.experts = RoutedExperts.gated(*expert_stacks(t, p, self.E, ("w1", "w3", "w2")), dtype)
        self.shared = GatedMLP.named(t, f"{p}.shared_experts", dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k])."""
        scores = sigmoid_each(rowwise_linear(x.float(), self.w_router))         # [N, E]
        choice = scores + self.score_bias
        if self.groups > 1:
            per = self.E // self.groups
            group_scores = choice.view(-1, self.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(
                1, torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1], 1)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(per, dim=1), float("-inf"))
        chosen = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def forward(self, x):
        weights, chosen = self.route(x)
        return self.experts.forward(x, weights, chosen) + self.shared.forward(x)


class Block(HybridBlock):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        p = f"model.layers.{i}"
        mixers = {LINEAR: lambda: DeltaAttention(a, t, f"{p}.self_attn", dtype),
                  FULL: lambda: LatentAttention(a, t, f"{p}.self_attn", dtype)}
        super().__init__(a, t, p, a.layer_types[i], dtype, mixers, "Kimi Linear layer type")
        # the released files name the MoE ``block_sparse_moe`` and the dense MLP ``mlp``;
        # save_pretrained writes ``block_sparse_moe`` for both, transformers' state_dict ``mlp``
        q = f"{p}.mlp" if any(k.startswith(f"{p}.mlp.") for k in t) else f"{p}.block_sparse_moe"
        self.mlp = MoE(a, t, q, dtype) if a.mlp_layer_types[i] == "sparse" else GatedMLP.named(t, q, dtype)


class KimiLinearModel(Model):
    family = "kimi_linear"
    Args = ModelArgs
    packable_weights = ("w_in", "w_f_b", "w_g_b", "w_out", "wq", "w_q_a", "w_q_b", "w_kv_a", "wo", "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        decoder_weights(self, tensors, args, dtype, Block)

    def cache_specs(self):
        out = []
        for layer in self.layers:
            if layer.kind == LINEAR:
                # float32 whatever the compute dtype, as transformers keeps the KDA state
                out.append(specs.recurrent(state_dtype="float32", **layer.mixer.state_fields()))
            else:
                out.append(specs.full(*layer.mixer.cache_dims()))
        return out

    def forward(self, batch):
        x = embedding(batch.tokens, self.embed, self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i)
        return self.final_logits(x, batch)
