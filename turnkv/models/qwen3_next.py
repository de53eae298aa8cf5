"""Qwen3-Next: gated delta-net linear attention (conv + recurrent state) on most layers, gated full
attention (output gate, partial rotary, (1 + w) QK-norm) on every ``full_attention_interval``-th
layer, and a routed MoE with a sigmoid-gated shared expert as the feed-forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..kernels import GGUFWeight
from .batch import Batch, Span, spans_apply
from .base import Model, attention_spans, each_row, embedding, linear, rms_norm, rowwise_linear, sigmoid_each
from .decoder import DecoderArgs, GatedMLP, HybridBlock, apply_partial_rope, norm_plus_one, out_weights, rope_for
from .experts import RoutedExperts, expert_stacks
from .rope_config import rope_params
from .ssm import causal_conv1d, gated_delta_chunked, gated_delta_step, l2norm
from .tensors import fused_weight, param, stored, take, weight

LINEAR, FULL = "linear_attention", "full_attention"
DELTA_CHUNK = 64  # the chunk transformers' torch path uses; any size gives the same result


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    computes = {"hidden_act": ("silu",)}      # the MLPs' and the delta-net conv's activation
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: list | None = None
    layer_types: list | None = None
    full_attention_interval: int = 4
    # value heads in llama.cpp's GGUF order (qwen35 / qwen35moe files): tiled over the key heads
    # (value head j * nk + g reads key head g), not grouped by key head as transformers holds them
    linear_value_heads_tiled: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        if not self.layer_types:
            n = self.full_attention_interval
            self.layer_types = [FULL if (i + 1) % n == 0 else LINEAR for i in range(self.num_hidden_layers)]

    def is_moe(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


class GatedDeltaNet(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.nk, self.nv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = a.linear_conv_kernel_dim
        self.eps = a.rms_norm_eps
        self.tiled = a.linear_value_heads_tiled
        self.w_in = fused_weight(self.input_parts(t, p, a.hidden_size), dtype)
        self.w_conv = param(take(t, f"{p}.conv1d.weight").reshape(self.conv_dim, self.kernel), dtype)
        self.dt_bias = param(take(t, f"{p}.dt_bias"), torch.float32)
        self.neg_A = param(-take(t, f"{p}.A_log").float().exp(), torch.float32)
        self.w_norm = param(take(t, f"{p}.norm.weight"), dtype)
        self.w_out = weight(stored(t, f"{p}.out_proj.weight"), dtype)

    def input_parts(self, t: dict, p: str, H: int) -> list:
        """The fused input projection, rows [q_all, k_all, v_all, z_all, b_all, a_all]."""
        r = self.nv // self.nk
        # transformers interleaves q|k|v|z (and b|a) per key-head group; regroup the rows once so one
        # matmul yields [q_all, k_all, v_all, z_all, b_all, a_all] and q|k|v is a contiguous slice
        qkvz = take(t, f"{p}.in_proj_qkvz.weight").view(self.nk, 2 * self.dk + 2 * r * self.dv, H)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=1)
        b, a_ = take(t, f"{p}.in_proj_ba.weight").view(self.nk, 2 * r, H).split([r, r], dim=1)
        return [torch.cat([w.reshape(-1, H) for w in (q, k, v, z, b, a_)])]

    def state_fields(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, self.conv_dim), "recurrent": (self.nv, self.dk, self.dv)}

    def repeat_heads(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """[T, nk, d] -> [T, nv, d], each key head serving r value heads: the r adjacent (grouped,
        transformers' order) or every nk-th (tiled, ``linear_value_heads_tiled``)."""
        return x.repeat(1, r, 1) if self.tiled else x.repeat_interleave(r, dim=1)

    def forward(self, x, batch: Batch, i: int):
        N = x.shape[0]
        r = self.nv // self.nk
        qkv_all, z, b, a = linear(x, self.w_in).split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)

        def one(s: Span):   # conv window and delta rule: this sequence's rows over its own state
            cache, T = s.caches[i], s.length
            qkv, conv_state = causal_conv1d(qkv_all[s.rows], cache.state["conv"], self.w_conv, None)
            cache.set("conv", conv_state)
            q, k, v = each_row(F.silu, qkv).float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            # one query/key head serves r value heads (consecutive, or every nk-th when tiled)
            q = self.repeat_heads(l2norm(q.view(T, self.nk, self.dk)), r).transpose(0, 1) * self.dk ** -0.5
            k = self.repeat_heads(l2norm(k.view(T, self.nk, self.dk)), r).transpose(0, 1)
            v = v.view(T, self.nv, self.dv).transpose(0, 1)
            # each_row: a gate's bits must not depend on the rows beside it (vector body or scalar
            # tail, a thread split inside a row), so a decode step's one row gets them too
            beta = each_row(torch.sigmoid, b[s.rows].float()).t()                          # [nv, T]
            g = (self.neg_A * each_row(F.softplus, a[s.rows].float() + self.dt_bias)).t()  # log decay, [nv, T]
            state = cache.state["recurrent"]
            if T == 1:
                o, state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
                o = o[:, None]
            else:
                o, state = gated_delta_chunked(q, k, v, g, beta, state, DELTA_CHUNK)
            cache.set("recurrent", state)
            cache.advance(T)
            # [T, nv, dv], contiguous as a multi-span concatenation is (the norm reduces in layout order)
            return o.transpose(0, 1).contiguous()
        # per-head RMSNorm first, then the SiLU(z) gate
        o = rms_norm(spans_apply(batch, one, i).to(x.dtype), self.w_norm, self.eps)
        o = (o * each_row(F.silu, z.float()).view(N, self.nv, self.dv)).to(x.dtype)
        return linear(o.reshape(N, self.value_dim), self.w_out)


def query_gate_rows(w, heads: int, d: int) -> tuple:
    """q_proj's query rows and gate rows (transformers packs [query | gate] per head). A GGUF
    weight's rows move with their blocks unchanged, so the fused projection stays one GGUF
    matmul: the same on every row count, as speculative decoding needs (docs/speculative.md)."""
    order = torch.arange(heads * 2 * d).view(heads, 2, d)
    query, gate = order[:, 0].reshape(-1), order[:, 1].reshape(-1)
    if isinstance(w, GGUFWeight):
        return w.take_rows(query), w.take_rows(gate)
    return w[query], w[gate]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        # q_proj packs [query | gate] per head; regroup as q | k | v | gate for one fused matmul
        q, gate = query_gate_rows(stored(t, f"{p}.q_proj.weight"), self.hq, self.d)
        self.wqkvg = fused_weight([q, stored(t, f"{p}.k_proj.weight"), stored(t, f"{p}.v_proj.weight"), gate], dtype)
        self.bqkvg = None
        if a.attention_bias:
            qb, gb = take(t, f"{p}.q_proj.bias").view(self.hq, 2, self.d).unbind(1)
            self.bqkvg = param(torch.cat([qb.reshape(-1), take(t, f"{p}.k_proj.bias"),
                                          take(t, f"{p}.v_proj.bias"), gb.reshape(-1)]), dtype)
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)
        self.q_norm = norm_plus_one(take(t, f"{p}.q_norm.weight"), dtype)
        self.k_norm = norm_plus_one(take(t, f"{p}.k_norm.weight"), dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk, d = self.hq, self.hk, self.d
        qkv, gate = linear(x, self.wqkvg, self.bqkvg).split([(hq + 2 * hk) * d, hq * d], dim=-1)
        qkv = qkv.view(x.shape[0], hq + 2 * hk, d).transpose(0, 1)
        q = apply_partial_rope(rms_norm(qkv[:hq], self.q_norm, self.eps), *rope)
        k = apply_partial_rope(rms_norm(qkv[hq:hq + hk], self.k_norm, self.eps), *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        out = attention_spans(batch, i, q, k, qkv[hq + hk:], self.scale)
        return linear(out * each_row(torch.sigmoid, gate), self.wo, self.bo)


class SparseMoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k, self.norm_topk = a.num_experts_per_tok, a.norm_topk_prob
        self.w_router = param(take(t, f"{p}.gate.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        self.experts = RoutedExperts.gated(*expert_stacks(t, p, a.num_experts), dtype)
        self.shared = GatedMLP.named(t, f"{p}.shared_expert", dtype)
        self.w_shared_gate = param(take(t, f"{p}.shared_expert_gate.weight"), torch.float32)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k])."""
        probs = torch.softmax(rowwise_linear(x, self.w_router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)             # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's sigmoid gate [T, 1]: a float matrix as the router, and one value a row."""
        return sigmoid_each(rowwise_linear(x, self.w_shared_gate))

    def forward(self, x):
        out = self.experts.forward(x, *self.route(x))
        return out + self.shared.forward(x) * self.shared_gate(x)


class Block(HybridBlock):
    delta_net = GatedDeltaNet   # qwen3_5.py swaps in its un-interleaved projections
    rope_kinds = (FULL,)

    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        p = f"model.layers.{i}"
        mixers = {LINEAR: lambda: self.delta_net(a, t, f"{p}.linear_attn", dtype),
                  FULL: lambda: Attention(a, t, f"{p}.self_attn", dtype)}
        super().__init__(a, t, p, a.layer_types[i], dtype, mixers, "Qwen3-Next layer type", norm=norm_plus_one)
        self.mlp = SparseMoE(a, t, f"{p}.mlp", dtype) if a.is_moe(i) else GatedMLP.named(t, f"{p}.mlp", dtype)


class Qwen3NextModel(Model):
    family = "qwen3_next"
    Args = ModelArgs
    block = Block

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = weight(stored(tensors, "model.embed_tokens.weight"), dtype)
        self.layers = nn.ModuleList(self.block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = norm_plus_one(take(tensors, "model.norm.weight"), dtype)
        head = tensors.get("lm_head.weight")
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else weight(head, dtype)
        params = rope_params(config)
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        self.rope = rope_for(params, args.head_dim, dtype, partial)

    def cache_specs(self):
        a = self.args
        return [specs.recurrent(**layer.mixer.state_fields()) if layer.kind == LINEAR
                else specs.full(a.num_key_value_heads, a.head_dim) for layer in self.layers]

    def forward(self, batch):
        rope = self.rope.rows(batch)
        x = embedding(batch.tokens, self.embed, self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)
