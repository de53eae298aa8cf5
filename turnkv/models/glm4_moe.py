"""GLM-4 MoE (GLM-4.5 / 4.6 / 4.7, ``glm4_moe``): full attention on every layer with biased q/k/v,
an optional per-head RMS QK-norm before RoPE, partial RoPE (half-split on the first
``partial_rotary_factor`` of each head, 0.5 by default); dense SwiGLU MLPs on the first
``first_k_dense_replace`` layers and a DeepSeek-V3-style MoE on the rest: a float32 router, sigmoid
scores, an ``e_score_correction_bias`` that only steers the choice, group-limited selection (the
``topk_group`` groups whose best two biased scores sum highest, out of ``n_group``), top-k of the
biased scores within them, weights = the chosen *unbiased* sigmoid scores, renormalised
(``norm_topk_prob``, + 1e-20) and multiplied by ``routed_scaling_factor``; plus shared experts (one
SwiGLU of ``moe_intermediate_size * n_shared_experts``) on every MoE layer.

The released checkpoints carry one MTP (next-token prediction) layer after the last decoder layer
(``model.layers.{num_hidden_layers}``); it is not part of the decoder and is ignored."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import attention_spans, linear, rms_norm, rowwise_linear, sigmoid_each
from .batch import Batch
from .decoder import DecoderArgs, DecoderModel, GatedMLP, PreNormBlock, apply_partial_rope, qkv_weights, rope_for
from .experts import RoutedExperts, expert_stacks
from .rope_config import rope_params
from .tensors import param, stored, take, weight

DEFAULT_PARTIAL_ROTARY = 0.5


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    computes = {"hidden_act": ("silu",), "sliding_window": ()}
    attention_bias: bool = False
    use_qk_norm: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        self.wqkv, self.bqkv = qkv_weights(t, p, dtype, a.attention_bias)
        self.wo = weight(stored(t, f"{p}.o_proj.weight"), dtype)            # o_proj never has a bias
        self.q_norm = self.k_norm = None
        if a.use_qk_norm:
            self.q_norm = param(take(t, f"{p}.q_norm.weight"), dtype)
            self.k_norm = param(take(t, f"{p}.k_norm.weight"), dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        q, k = qkv[:hq], qkv[hq:hq + hk]
        if self.q_norm is not None:   # per head, before RoPE
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = apply_partial_rope(q, *rope), apply_partial_rope(k, *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, q, k, qkv[hq + hk:], self.scale), self.wo)


class MoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.norm_topk, self.scaling = a.norm_topk_prob, a.routed_scaling_factor
        self.n_experts = a.n_routed_experts
        # transformers keeps the router and its bias in float32 whatever the model's dtype
        self.w_router = param(take(t, f"{p}.gate.weight"), torch.float32)
        bias = t.get(f"{p}.gate.e_score_correction_bias")
        self.score_bias = param(bias if bias is not None else torch.zeros(self.n_experts), torch.float32)
        self.experts = RoutedExperts.gated(*expert_stacks(t, p, self.n_experts), dtype)
        self.shared = GatedMLP.named(t, f"{p}.shared_experts", dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k]) exactly as transformers' Glm4MoeTopkRouter."""
        scores = sigmoid_each(rowwise_linear(x.float(), self.w_router))
        choice = scores + self.score_bias
        N, G = x.shape[0], self.n_group
        group_scores = choice.view(N, G, -1).topk(2, dim=-1)[0].sum(dim=-1)           # [N, G]
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep[:, :, None].expand(N, G, self.n_experts // G).reshape(N, self.n_experts)
        chosen = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def forward(self, x):
        weights, chosen = self.route(x)
        return self.experts.forward(x, weights, chosen) + self.shared.forward(x)


class Block(PreNormBlock):
    Attention = Attention

    def make_mlp(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        return MoE(a, t, p, dtype) if i >= a.first_k_dense_replace else GatedMLP.named(t, p, dtype)


class Glm4MoeModel(DecoderModel):
    family = "glm4_moe"
    Args = ModelArgs
    Block = Block

    def set_rope(self, config: dict) -> None:
        params = rope_params(config)
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
        self.rope = rope_for(params, self.args.head_dim, self.dtype, partial)
