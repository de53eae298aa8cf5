"""Llama (SmolLM2 and friends): full attention on every layer, fused QKV and gate/up projections."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .batch import Batch
from .fused import FusedSlot, fuse_llama_block, stack_for
from .base import (BaseArgs, Model, Rope, apply_rope, attention_spans, embedding, linear, param, rms_norm,
                   take)
from .rope_config import inv_freq_for, rope_params
from .tensors import fused_weight, stored, weight


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.wqkv = fused_weight([stored(t, f"{p}.q_proj.weight"), stored(t, f"{p}.k_proj.weight"),
                                  stored(t, f"{p}.v_proj.weight")], dtype)
        self.bqkv = (param(torch.cat([take(t, f"{p}.q_proj.bias"), take(t, f"{p}.k_proj.bias"),
                                      take(t, f"{p}.v_proj.bias")]), dtype) if a.attention_bias else None)
        self.wo = weight(stored(t, f"{p}.o_proj.weight"), dtype)
        self.bo = param(take(t, f"{p}.o_proj.bias"), dtype) if a.attention_bias else None

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = apply_rope(qkv[: hq + hk], *rope)
        # each sequence's rows over its own KV
        out = attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale)
        return linear(out, self.wo, self.bo)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.wgu = fused_weight([stored(t, f"{p}.gate_proj.weight"), stored(t, f"{p}.up_proj.weight")], dtype)
        self.wdown = weight(stored(t, f"{p}.down_proj.weight"), dtype)
        self.bgu = (param(torch.cat([take(t, f"{p}.gate_proj.bias"), take(t, f"{p}.up_proj.bias")]), dtype)
                    if a.mlp_bias else None)
        self.bdown = param(take(t, f"{p}.down_proj.bias"), dtype) if a.mlp_bias else None

    def forward(self, x):
        g, u = linear(x, self.wgu, self.bgu).chunk(2, dim=-1)
        # in place on the fresh gate/up output: no extra [T, intermediate] allocations
        return linear(F.silu(g, inplace=True).mul_(u), self.wdown, self.bdown)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.ln_attn = param(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_mlp = param(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype)
        self.mlp = MLP(a, t, f"{p}.mlp", dtype)

    fused = FusedSlot()     # its FusedBlock, or None

    def fuse(self) -> bool:
        """Run the block as two native calls (models/fused.py) when its weights allow it."""
        self.fused = fuse_llama_block(self)
        return self.fused is not None

    def forward(self, x, batch, i, rope):
        f = self.fused
        if f is not None and f.takes(x):
            return f.layer(x, rope, batch, i, self.attn.scale)
        # x is the model's own residual buffer (fresh from the embedding): accumulate in place
        x += self.attn.forward(rms_norm(x, self.ln_attn, self.eps), batch, i, rope)
        x += self.mlp.forward(rms_norm(x, self.ln_mlp, self.eps))
        return x


class LlamaModel(Model):
    family = "llama"
    packable_weights = ("wqkv", "wo", "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.decoder_weights(tensors, args, dtype, Block)
        inv_freq, scaling = inv_freq_for(rope_params(config), args.head_dim)
        self.rope = Rope(args.head_dim, 0.0, dtype, inv_freq=inv_freq, attention_scaling=scaling)

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(ModelArgs.from_dict(config), config, tensors, dtype)

    def cache_specs(self):
        a = self.args
        return [specs.full(a.num_key_value_heads, a.head_dim) for _ in range(a.num_hidden_layers)]

    def forward(self, batch):
        return self.forward_embeds(embedding(batch.tokens, self.embed, self.dtype), batch)

    def forward_embeds(self, x, batch):
        """The decoder over given input embeddings [N, hidden] (a fresh buffer: the blocks add into
        it in place); a vision family (models/idefics3.py) puts image rows in. All layers in one
        native call when they are fused (models/fused.py FusedStack), else one by one."""
        rope = self.rope.rows(batch)
        stack = stack_for(self, lambda: [layer.attn.scale for layer in self.layers],
                          lambda: [None] * len(self.layers), lambda: [0] * len(self.layers))
        if stack is not None and stack.run(x, batch, [rope]):
            return self.final_logits(x, batch)
        return self.run_decoder(x, batch, rope)
