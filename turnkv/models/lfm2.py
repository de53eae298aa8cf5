"""LFM2: gated short-convolution layers mixed with full-attention layers (QK RMSNorm, RoPE),
SwiGLU feed-forward on every layer.

A conv layer's state is the last ``L_cache - 1`` gated inputs of its depthwise convolution
(``conv`` field of a recurrent cache, [L_cache - 1, hidden] as every family in ssm.py keeps it); it
cannot be rewound, so the model is a hybrid for the prompt cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import specs
from .batch import Batch, Span, spans_apply
from .base import BaseArgs, Model, apply_rope, attention_spans, embedding, linear, rms_norm
from .decoder import GatedMLP, embedding_and_head, qkv_weights, rope_for
from .rope_config import rope_params
from .ssm import causal_conv1d
from .tensors import param, stored, take, weight

CONV, ATTENTION = "conv", "full_attention"


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    norm_eps: float = 1e-5
    conv_L_cache: int = 3
    conv_bias: bool = False
    full_attn_idxs: list | None = None
    layer_types: list | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:
            idxs = self.full_attn_idxs if self.full_attn_idxs is not None else range(self.num_hidden_layers)
            self.layer_types = [ATTENTION if i in idxs else CONV for i in range(self.num_hidden_layers)]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class ShortConv(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.w_in = weight(stored(t, f"{p}.in_proj.weight"), dtype)
        self.w_conv = param(take(t, f"{p}.conv.weight").squeeze(1), dtype)
        self.w_out = weight(stored(t, f"{p}.out_proj.weight"), dtype)
        bias = a.conv_bias
        self.b_in = param(take(t, f"{p}.in_proj.bias"), dtype) if bias else None
        self.b_conv = param(take(t, f"{p}.conv.bias"), dtype) if bias else None
        self.b_out = param(take(t, f"{p}.out_proj.bias"), dtype) if bias else None

    def forward(self, x, batch: Batch, i: int):
        b, c, h = linear(x, self.w_in, self.b_in).chunk(3, dim=-1)
        bh = b * h

        def one(s: Span):   # the conv window: this sequence's rows over its own state
            cache = s.caches[i]
            y, conv_state = causal_conv1d(bh[s.rows], cache.state["conv"], self.w_conv, self.b_conv)
            cache.set("conv", conv_state)
            cache.advance(s.length)
            return y
        return linear(c * spans_apply(batch, one, i), self.w_out, self.b_out)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.norm_eps
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.wo = weight(stored(t, f"{p}.out_proj.weight"), dtype)
        self.q_norm = param(take(t, f"{p}.q_layernorm.weight"), dtype)
        self.k_norm = param(take(t, f"{p}.k_layernorm.weight"), dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        q = apply_rope(rms_norm(qkv[:hq], self.q_norm, self.eps), *rope)
        k = apply_rope(rms_norm(qkv[hq: hq + hk], self.k_norm, self.eps), *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, q, k, qkv[hq + hk:], self.scale), self.wo)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.norm_eps
        self.is_attention = a.layer_types[i] != CONV
        self.ln_op = param(take(t, f"{p}.operator_norm.weight"), dtype)
        self.ln_ffn = param(take(t, f"{p}.ffn_norm.weight"), dtype)
        self.mixer = Attention(a, t, f"{p}.self_attn", dtype) if self.is_attention else ShortConv(a, t, f"{p}.conv", dtype)
        self.mlp = GatedMLP.named(t, f"{p}.feed_forward", dtype, names=("w1", "w3", "w2"))

    def forward(self, x, batch, i, rope):
        h = rms_norm(x, self.ln_op, self.eps)
        x = x + (self.mixer.forward(h, batch, i, rope) if self.is_attention else self.mixer.forward(h, batch, i))
        return x + self.mlp.forward(rms_norm(x, self.ln_ffn, self.eps))


class Lfm2Model(Model):
    family = "lfm2"
    Args = ModelArgs
    packable_weights = ("w_in", "w_out", "wqkv", "wo", "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed, self.lm_head = embedding_and_head(tensors, dtype, args.tie_word_embeddings)
        self.layers = nn.ModuleList(Block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = param(take(tensors, "model.embedding_norm.weight"), dtype)
        self.rope = rope_for(rope_params(config), args.head_dim, dtype)

    def cache_specs(self):
        a = self.args
        return [specs.recurrent(conv=(a.conv_L_cache - 1, a.hidden_size)) if lt == CONV
                else specs.full(a.num_key_value_heads, a.head_dim) for lt in a.layer_types]

    def forward(self, batch):
        return self.forward_embeds(embedding(batch.tokens, self.embed, self.dtype), batch)

    def forward_embeds(self, x, batch):
        """The decoder over input embeddings ``x`` [N, hidden] (LFM2-VL puts image rows in them)."""
        rope = self.rope.rows(batch)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)

    def head(self, x):
        return linear(rms_norm(x, self.norm, self.args.norm_eps), self.lm_head)
