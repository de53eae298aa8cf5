"""Gemma 3 (text): sliding-window attention on local layers, full attention on every
``sliding_window_pattern``-th layer, QK-norm, sandwich norms, scaled embeddings, GELU-tanh MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import specs
from .batch import Batch, Span, select_rows, spans_apply
from .base import BaseArgs, Model, Rope, apply_rope, attention, embedding, linear, param, rms_norm, take
from .rope_config import inv_freq_for, rope_params

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4096
    layer_types: list | None = None
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not self.layer_types:
            n = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % n == 0 else SLIDING for i in range(self.num_hidden_layers)]


def _norm_weight(t: torch.Tensor, dtype) -> nn.Parameter:
    # Gemma scales by (1 + w); fold the 1 in once at load time.
    return param(1.0 + t.float(), dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, sliding: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.query_pre_attn_scalar ** -0.5
        self.softcap = a.attn_logit_softcapping
        self.eps = a.rms_norm_eps
        self.sliding = sliding
        self.wqkv = param(torch.cat([take(t, f"{p}.q_proj.weight"), take(t, f"{p}.k_proj.weight"),
                                     take(t, f"{p}.v_proj.weight")]), dtype)
        self.wo = param(take(t, f"{p}.o_proj.weight"), dtype)
        # q_norm repeated over the query heads and k_norm over the kv heads, [hq + hk, 1, D]: q and k
        # are normalized (and then rotated) together, one op each instead of two
        q_norm = take(t, f"{p}.q_norm.weight")[None].expand(self.hq, -1)
        k_norm = take(t, f"{p}.k_norm.weight")[None].expand(self.hk, -1)
        self.qk_norm = _norm_weight(torch.cat([q_norm, k_norm])[:, None], dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        # same order as transformers' Gemma3RMSNorm: normalize, then scale by (1 + w)
        qk = apply_rope(rms_norm(qkv[: hq + hk], None, self.eps).mul_(self.qk_norm), *rope)

        def one(s: Span):   # this sequence's rows over its own KV
            view = s.caches[i].update_and_fetch(qk[hq:, s.rows], qkv[hq + hk:, s.rows])
            return attention(qk[:hq, s.rows], view, self.scale, self.softcap)
        return linear(spans_apply(batch, one), self.wo)


class MLP(nn.Module):
    def __init__(self, t: dict, p: str, dtype):
        super().__init__()
        self.wgu = param(torch.cat([take(t, f"{p}.gate_proj.weight"), take(t, f"{p}.up_proj.weight")]), dtype)
        self.wdown = param(take(t, f"{p}.down_proj.weight"), dtype)

    def forward(self, x):
        g, u = linear(x, self.wgu).chunk(2, dim=-1)
        # in place on the fresh gate/up output: no extra [T, intermediate] allocations
        return linear(torch.ops.aten.gelu_(g, approximate="tanh").mul_(u), self.wdown)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.sliding = a.layer_types[i] == SLIDING
        self.ln_in = _norm_weight(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_post_attn = _norm_weight(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.ln_pre_ff = _norm_weight(take(t, f"{p}.pre_feedforward_layernorm.weight"), dtype)
        self.ln_post_ff = _norm_weight(take(t, f"{p}.post_feedforward_layernorm.weight"), dtype)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, self.sliding)
        self.mlp = MLP(t, f"{p}.mlp", dtype)

    def forward(self, x, batch, i, rope):
        # x is the model's own residual buffer (fresh from the embedding): accumulate in place
        h = self.attn.forward(rms_norm(x, self.ln_in, self.eps), batch, i, rope)
        x += rms_norm(h, self.ln_post_attn, self.eps)
        h = self.mlp.forward(rms_norm(x, self.ln_pre_ff, self.eps))
        x += rms_norm(h, self.ln_post_ff, self.eps)
        return x


class Gemma3Model(Model):
    family = "gemma3"
    packable_weights = ("wqkv", "wo", "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = param(take(tensors, "model.embed_tokens.weight"), dtype)
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5).to(dtype)
        self.layers = nn.ModuleList(Block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = _norm_weight(take(tensors, "model.norm.weight"), dtype)
        head = tensors.get("lm_head.weight")
        # tied (transformers ignores a stored lm_head then): one table, packed once by weight formats
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else param(head, dtype)
        self.rope_global = self._rope(config, FULL, default_theta=1_000_000.0)
        self.rope_local = self._rope(config, SLIDING, default_theta=config.get("rope_local_base_freq", 10_000.0))

    def _rope(self, config: dict, layer_type: str, default_theta: float) -> Rope:
        params = rope_params(config, layer_type)
        if "rope_parameters" not in config or layer_type not in (config.get("rope_parameters") or {}):
            if layer_type == SLIDING:
                params = {"rope_theta": default_theta, "rope_type": "default"}
        inv_freq, scaling = inv_freq_for(params, self.args.head_dim)
        return Rope(self.args.head_dim, 0.0, self.dtype, inv_freq=inv_freq, attention_scaling=scaling)

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(ModelArgs.from_dict(config), config, tensors, dtype)

    def cache_specs(self):
        a = self.args
        return [specs.sliding(a.num_key_value_heads, a.head_dim, a.sliding_window) if lt == SLIDING
                else specs.full(a.num_key_value_heads, a.head_dim) for lt in a.layer_types]

    def forward(self, batch):
        rope_g, rope_l = self.rope_global.rows(batch), self.rope_local.rows(batch)
        x = embedding(batch.tokens, self.embed, self.dtype) * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope_l if layer.sliding else rope_g)
        x = select_rows(x, batch)
        if x is None:
            return None
        out = linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out
