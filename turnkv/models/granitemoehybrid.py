"""Granite 4 hybrid (GraniteMoeHybrid): Mamba 2 mixer layers and attention layers, each followed by
a top-k softmax-routed MoE plus a shared SwiGLU MLP; Granite's embedding / residual / attention
multipliers and logit scaling.

The Mamba 2 mixer is the one in ssm.py (shared with the mamba2 family): its state is the causal-conv
window (``conv``: the last ``d_conv - 1`` inputs) and the SSM state (``ssm``: [heads, head_dim,
d_state]); prefill runs the chunked SSD scan from the cached state, decode the one-step recurrence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .batch import Batch
from .base import BaseArgs, Model, apply_rope, attention_spans, linear, rms_norm, rowwise_linear
from .decoder import GatedMLP, decoder_weights, out_weights, qkv_weights, rope_for
from .experts import RoutedExperts
from .rope_config import rope_params
from .ssm import Mamba2Dims, Mamba2Mixer, mamba2_state_fields, time_step_limit
from .tensors import param, stored, take

MAMBA, ATTENTION = "mamba", "attention"
# config spellings: the hub's Granite 4 files say mamba/attention, transformers writes linear/full
_LAYER_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclass
class ModelArgs(BaseArgs):
    computes = {"hidden_act": ("silu",)}
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 11008
    shared_intermediate_size: int = 1024
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    position_embedding_type: str | None = None
    layer_types: list | None = None
    layers_block_type: list | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list | tuple | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        types = self.layer_types or self.layers_block_type or [MAMBA] * self.num_hidden_layers
        try:
            self.layer_types = [_LAYER_KINDS[t] for t in types]
        except KeyError as e:
            raise ValueError(f"granitemoehybrid: unknown layer type {e.args[0]!r}") from None
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_intermediate // self.mamba_n_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    def mamba_dims(self) -> Mamba2Dims:
        return Mamba2Dims(self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state,
                          self.mamba_n_groups, self.mamba_d_conv, self.mamba_chunk_size, self.rms_norm_eps,
                          self.mamba_proj_bias, self.mamba_conv_bias, time_step_limit(self.time_step_limit))


# --- attention, MoE, MLP ---------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.attention_multiplier
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.bqkv = (param(torch.cat([take(t, f"{p}.q_proj.bias"), take(t, f"{p}.k_proj.bias"),
                                      take(t, f"{p}.v_proj.bias")]), dtype) if a.attention_bias else None)
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = qkv[: hq + hk] if rope is None else apply_rope(qkv[: hq + hk], *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale), self.wo, self.bo)


def _take_either(t: dict, name: str, alias: str) -> torch.Tensor:
    # save_pretrained writes the hub's original names; state_dict() has transformers' renamed ones
    return t[alias] if name not in t and alias in t else take(t, name)


class MoE(nn.Module):
    """Top-k experts by router logit, weighted by the softmax over the chosen logits."""

    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k = a.num_experts_per_tok
        # float32 once, as rowwise_linear runs
        self.router = param(_take_either(t, f"{p}.router.weight", f"{p}.router.layer.weight"), torch.float32)
        self.experts = RoutedExperts.gated(_take_either(t, f"{p}.experts.gate_up_proj", f"{p}.input_linear.weight"),
                                           _take_either(t, f"{p}.experts.down_proj", f"{p}.output_linear.weight"),
                                           dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype: the softmax over the chosen logits, experts [N, k])."""
        top_v, top_i = rowwise_linear(x, self.router).float().topk(self.top_k, dim=-1)
        return torch.softmax(top_v, dim=-1).to(x.dtype), top_i

    def forward(self, x):
        return self.experts.forward(x, *self.route(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps, self.res = a.rms_norm_eps, a.residual_multiplier
        self.is_mamba = a.layer_types[i] == MAMBA
        self.ln_in = param(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_post = param(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.mixer = Mamba2Mixer(a.mamba_dims(), t, f"{p}.mamba", dtype) if self.is_mamba else Attention(a, t, f"{p}.self_attn", dtype)
        self.moe = MoE(a, t, f"{p}.block_sparse_moe", dtype) if a.num_local_experts > 0 else None
        self.shared = GatedMLP([stored(t, f"{p}.shared_mlp.input_linear.weight")],
                               stored(t, f"{p}.shared_mlp.output_linear.weight"), dtype)

    def forward(self, x, batch, i, rope):
        h = rms_norm(x, self.ln_in, self.eps)
        h = self.mixer.forward(h, batch, i) if self.is_mamba else self.mixer.forward(h, batch, i, rope)
        x = x + h * self.res
        h = rms_norm(x, self.ln_post, self.eps)
        h = self.shared.forward(h) if self.moe is None else self.moe.forward(h) + self.shared.forward(h)
        return x + h * self.res


class GraniteMoeHybridModel(Model):
    family = "granitemoehybrid"
    Args = ModelArgs

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        decoder_weights(self, tensors, args, dtype, Block)
        self.rope = None
        if args.position_embedding_type == "rope":
            self.rope = rope_for(rope_params(config), args.head_dim, dtype)

    def cache_specs(self):
        a = self.args
        mamba = specs.recurrent(**mamba2_state_fields(a.mamba_dims()))
        return [mamba if lt == MAMBA else specs.full(a.num_key_value_heads, a.head_dim) for lt in a.layer_types]

    def forward(self, batch):
        rope = self.rope.rows(batch) if self.rope is not None else None
        x = F.embedding(batch.tokens, self.embed) * self.args.embedding_multiplier
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)

    def head(self, x):
        return linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head) / self.args.logits_scaling
