"""AFMoE (Arcee Trinity, ``afmoe``): sliding-window attention with RoPE on most layers and NoPE full
attention on every ``global_attn_every_n_layers``-th (``layer_types``); every attention has a per-head
RMS QK-norm and a sigmoid output gate (``gate_proj``, applied before ``o_proj``); each block
normalises around both branches (input / post-attention, pre-MLP / post-MLP RMSNorms, the post ones
on the branch output before the residual add); dense SwiGLU on the first ``num_dense_layers``, a
token-choice MoE on the rest: sigmoid scores, top-k of the scores plus ``expert_bias`` (which only
steers the choice), weights = the chosen unbiased scores renormalised (+ 1e-20) times
``route_scale``, plus shared experts (one SwiGLU of ``moe_intermediate_size * num_shared_experts``).
With ``mup_enabled`` the embeddings are multiplied by ``sqrt(hidden_size)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import apply_rope, attention_spans, each_row, embedding, linear, rms_norm, rowwise_linear, sigmoid_each
from .batch import Batch
from .decoder import FULL, SLIDING, DecoderArgs, DecoderModel, GatedMLP, float32_norm, out_weights
from .experts import RoutedExperts, expert_stacks
from .tensors import fused_weight, param, stored, take

def norm32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers keeps AFMoE's RMSNorms in float32 whatever the model's dtype
    (``_keep_in_fp32_modules``): normalise and scale in float32, then back to ``x``'s dtype."""
    return rms_norm(x.float(), w, eps).to(x.dtype)


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    computes = {"hidden_act": ("silu",)}
    moe_intermediate_size: int = 1408
    num_dense_layers: int = 1
    head_dim: int | None = 128
    num_experts: int = 64
    num_experts_per_tok: int = 6
    num_shared_experts: int = 2
    route_scale: float = 1.0
    global_attn_every_n_layers: int = 4
    sliding_window: int | None = 1024
    layer_types: list | None = None
    mup_enabled: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not self.layer_types:   # transformers' default: every n-th layer global
            n = self.global_attn_every_n_layers
            self.layer_types = [SLIDING if (i + 1) % n else FULL for i in range(self.num_hidden_layers)]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, sliding: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        self.rotate = sliding   # the global (full) layers are NoPE
        # q | k | v | gate in one matmul; only q/k/v may have a bias
        self.wqkvg = fused_weight([stored(t, f"{p}.q_proj.weight"), stored(t, f"{p}.k_proj.weight"),
                                   stored(t, f"{p}.v_proj.weight"), stored(t, f"{p}.gate_proj.weight")], dtype)
        self.bqkvg = None
        if a.attention_bias:
            self.bqkvg = param(torch.cat([take(t, f"{p}.q_proj.bias"), take(t, f"{p}.k_proj.bias"),
                                          take(t, f"{p}.v_proj.bias"),
                                          torch.zeros(self.hq * self.d)]), dtype)
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)
        self.q_norm = param(take(t, f"{p}.q_norm.weight"), torch.float32)
        self.k_norm = param(take(t, f"{p}.k_norm.weight"), torch.float32)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk, d = self.hq, self.hk, self.d
        qkv, gate = linear(x, self.wqkvg, self.bqkvg).split([(hq + 2 * hk) * d, hq * d], dim=-1)
        qkv = qkv.view(x.shape[0], hq + 2 * hk, d).transpose(0, 1)
        q = norm32(qkv[:hq], self.q_norm, self.eps)
        k = norm32(qkv[hq:hq + hk], self.k_norm, self.eps)
        if self.rotate:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        out = attention_spans(batch, i, q, k, qkv[hq + hk:], self.scale)
        return linear(out * each_row(torch.sigmoid, gate), self.wo, self.bo)


class MoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k, self.scaling = a.num_experts_per_tok, a.route_scale
        self.w_router = param(take(t, f"{p}.router.gate.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        self.expert_bias = param(take(t, f"{p}.expert_bias"), torch.float32)   # float32 in transformers too
        self.experts = RoutedExperts.gated(*expert_stacks(t, p, a.num_experts), dtype)
        self.shared = GatedMLP.named(t, f"{p}.shared_experts", dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k]) exactly as transformers' AfmoeTokenChoiceRouter."""
        scores = sigmoid_each(rowwise_linear(x, self.w_router).float())
        chosen = torch.topk(scores + self.expert_bias, k=self.top_k, dim=1)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def forward(self, x):
        weights, chosen = self.route(x)
        return self.shared.forward(x) + self.experts.forward(x, weights, chosen)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.sliding = a.layer_types[i] == SLIDING
        f32 = torch.float32
        self.ln_in = param(take(t, f"{p}.input_layernorm.weight"), f32)
        self.ln_post_attn = param(take(t, f"{p}.post_attention_layernorm.weight"), f32)
        self.ln_pre_mlp = param(take(t, f"{p}.pre_mlp_layernorm.weight"), f32)
        self.ln_post_mlp = param(take(t, f"{p}.post_mlp_layernorm.weight"), f32)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, self.sliding)
        self.mlp = MoE(a, t, f"{p}.mlp", dtype) if i >= a.num_dense_layers else GatedMLP.named(t, f"{p}.mlp", dtype)

    def forward(self, x, batch, i, rope):
        h = self.attn.forward(norm32(x, self.ln_in, self.eps), batch, i, rope)
        x = x + norm32(h, self.ln_post_attn, self.eps)
        h = self.mlp.forward(norm32(x, self.ln_pre_mlp, self.eps))
        return x + norm32(h, self.ln_post_mlp, self.eps)


class AfmoeModel(DecoderModel):
    family = "afmoe"
    Args = ModelArgs
    Block = Block
    packable_weights = ("wqkvg", "wo", "wgu", "wdown")
    norm_weight = staticmethod(float32_norm)

    def forward(self, batch):
        rope = self.rope.rows(batch)
        x = embedding(batch.tokens, self.embed, self.dtype)
        if self.args.mup_enabled:
            x = x * (self.args.hidden_size ** 0.5)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)

    def head(self, x):
        return linear(norm32(x, self.norm, self.args.rms_norm_eps), self.lm_head)
