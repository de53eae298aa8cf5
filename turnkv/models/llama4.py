"""Llama 4 (text): chunked attention with RoPE on most layers, global NoPE layers with attention
temperature tuning, L2 QK-norm on the RoPE layers, and a top-k sigmoid-routed MoE with a shared
expert on every ``interleave_moe_layer_step``-th layer (dense SwiGLU elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .batch import Batch, Span, spans_apply
from .base import BaseArgs, Model, apply_rope, attention, linear, rms_norm, rowwise_linear, sigmoid_each
from .decoder import GatedMLP, decoder_weights, out_weights, rope_for
from .experts import RoutedExperts
from .rope_config import rope_params
from .tensors import param, take

CHUNKED, FULL = "chunked_attention", "full_attention"


@dataclass
class ModelArgs(BaseArgs):
    computes = {"hidden_act": ("silu",)}
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size_mlp: int = 16384
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: list | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: list | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self):
        # Same defaults as transformers' Llama4TextConfig, so a sparse config.json means the same model.
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        n = self.num_hidden_layers
        if not self.no_rope_layers:  # 1 = the layer uses RoPE (despite the name)
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = list(range(step - 1, n, step))
        if self.layer_types is None:
            self.layer_types = [CHUNKED if rope and self.attention_chunk_size is not None else FULL
                                for rope in self.no_rope_layers]


def interleaved_to_half(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows from Llama 4's interleaved RoPE pairs (0,1),(2,3),... to the
    half-split layout (i, i + D/2) that ``apply_rope`` rotates. q and k get the same permutation, so
    q.k and the L2 norm are unchanged, and the rotation becomes the usual one."""
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(heads * head_dim, *rest)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def temperature_scales(offset: int, T: int, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """[T, 1] query multipliers of the NoPE layers (arXiv 2501.19399): 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))."""
    pos = torch.arange(offset, offset + T, dtype=torch.float32)
    return (torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, use_rope: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        self.use_rope = use_rope
        self.qk_norm = a.use_qk_norm and use_rope
        self.temperature = a.attn_temperature_tuning and not use_rope

        def qk(name, heads):
            w = take(t, f"{p}.{name}")
            return interleaved_to_half(w, heads, self.d) if use_rope else w

        self.wqkv = param(torch.cat([qk("q_proj.weight", self.hq), qk("k_proj.weight", self.hk),
                                     take(t, f"{p}.v_proj.weight")]), dtype)
        self.bqkv = (param(torch.cat([qk("q_proj.bias", self.hq), qk("k_proj.bias", self.hk),
                                      take(t, f"{p}.v_proj.bias")]), dtype) if a.attention_bias else None)
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)

    def forward(self, x, batch: Batch, i: int, rope, temps):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = apply_rope(qkv[: hq + hk], *rope) if self.use_rope else qkv[: hq + hk]
        if self.qk_norm:   # after the rotation, as transformers does
            qk = l2_norm(qk, self.eps)

        def one(s: Span):   # this sequence's rows over its own KV, at its own positions
            q = qk[:hq, s.rows]
            if self.temperature:
                q = (q * temps[s]).to(x.dtype)
            return attention(q, s.caches[i].update_and_fetch(qk[hq:, s.rows], qkv[hq + hk:, s.rows]), self.scale)
        return linear(spans_apply(batch, one), self.wo, self.bo)


class MoE(nn.Module):
    """Top-k experts chosen on raw router logits; the sigmoid of each chosen logit scales the expert's
    *input* (transformers feeds every expert ``x * score`` with score 0 for the unchosen, whose output
    is then exactly 0, so running only the chosen experts is the same sum)."""

    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k = a.num_experts_per_tok
        self.router = param(take(t, f"{p}.router.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        # stored [E, H, 2I] / [E, I, H] for bmm; F.linear wants [out, in]
        gu, down = (take(t, f"{p}.experts.{n}").transpose(1, 2) for n in ("gate_up_proj", "down_proj"))
        self.experts = RoutedExperts.gated(gu, down, dtype)
        self.shared = GatedMLP.named(t, f"{p}.shared_expert", dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input scales [N, k] in x's dtype, experts [N, k])."""
        top_v, top_i = torch.topk(rowwise_linear(x, self.router), self.top_k, dim=1)
        return sigmoid_each(top_v.float()).to(x.dtype), top_i

    def forward(self, x):
        scores, top_i = self.route(x)
        return self.experts.forward(x, scores, top_i, out=self.shared.forward(x), scale_input=True)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.use_rope = bool(a.no_rope_layers[i])
        self.ln_attn = param(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_mlp = param(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, self.use_rope)
        self.ff = MoE(a, t, f"{p}.feed_forward", dtype) if i in a.moe_layers else GatedMLP.named(t, f"{p}.feed_forward", dtype)

    def forward(self, x, batch, i, rope, temps):
        x = x + self.attn.forward(rms_norm(x, self.ln_attn, self.eps), batch, i, rope, temps)
        return x + self.ff.forward(rms_norm(x, self.ln_mlp, self.eps))


class Llama4Model(Model):
    family = "llama4"
    Args = ModelArgs

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        decoder_weights(self, tensors, args, dtype, Block)
        self.rope = rope_for(rope_params(config), args.head_dim, dtype)
        self.any_temperature = args.attn_temperature_tuning and not all(args.no_rope_layers)

    def cache_specs(self):
        a = self.args
        return [specs.chunked(a.num_key_value_heads, a.head_dim, a.attention_chunk_size) if lt == CHUNKED
                else specs.full(a.num_key_value_heads, a.head_dim) for lt in a.layer_types]

    def forward(self, batch):
        a = self.args
        rope = self.rope.rows(batch)
        temps = ({s: temperature_scales(s.position, s.length, a.floor_scale, a.attn_scale).to(self.embed.device)
                  for s in batch.spans} if self.any_temperature else None)
        x = F.embedding(batch.tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope, temps)
        return self.final_logits(x, batch)
