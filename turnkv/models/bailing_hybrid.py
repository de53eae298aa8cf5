"""Bailing hybrid (inclusionAI Ling 3 / Ling-3.0-Flash; transformers' ``bailing_hybrid``): Kimi
Delta Attention (the per-channel gated delta rule after a short causal conv over q|k|v) on most
layers, Multi-head Latent Attention with RoPE and a per-head sigmoid output gate on every
``layer_group_size``-th layer, and DeepSeek-V3's MoE (sigmoid router, score-correction bias for the
choice only, group-limited top-k, renormalised and scaled, shared experts) after the first
``first_k_dense_replace`` dense layers, their SwiGLUs optionally clipped per layer
(``expert_swiglu_limit_list`` / ``share_expert_swiglu_limit_list``).

What differs from Kimi Linear (models/kimi_linear.py, whose KDA kernels, MLP and MoE this file
uses): the forget gate is one full-width projection ``f_proj`` and, with ``kda_safe_gate`` (the
default), bounded: ``g = kda_lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))`` (else
``-exp(A_log) * softplus(...)``); the output gate of the gated RMSNorm is one full-width ``g_proj``;
the MLA layers rotate ``k_rope`` and the rope part of each query with DeepSeek's interleaved RoPE and
multiply each head's output by ``sigmoid(g_proj(x))`` before ``o_proj``.

State per layer (``cache_specs()``):

* KDA layers: ``recurrent(conv, recurrent)`` (cache/recurrent.py's StateCache, the existing kind):
  ``conv [K-1, 3 * heads * head_dim]`` and ``recurrent [heads, head_dim, head_dim]``. Restorable
  only to its own length, so the family gets message-boundary checkpoints from the policy.
* MLA layers: ``full``, holding the compressed latent ``[kv_a_layernorm(c_kv) | rotated k_rope]``
  (one head of ``kv_lora_rank + qk_rope_head_dim`` channels, split in halves as the store's K and
  V); each step expands the held latents with ``kv_b_proj``, as transformers does.

The interleaved rotation (pairs ``(x0, x1), (x2, x3) ...``, output laid out ``[evens | odds]``) is
the usual half-split rotation of the de-interleaved vector, so the loader permutes the rope rows of
the query and ``kv_a_proj_with_mqa`` projections once ([evens | odds]); the products are the same
products, bit for bit.

Weights load under the released names save_pretrained writes (``model.word_embeddings``,
``attention.*``, ``attention.dense``, ``q/k/v_conv1d``, ``experts.{e}.gate_proj/up_proj/down_proj``,
``gate.expert_bias``) or transformers' in-memory names (``embed_tokens``, ``self_attn.*``,
``self_attn.forget_gate.*``, ``conv1d``, ``o_proj``, ``experts.gate_up_proj``,
``e_score_correction_bias``). The MTP layers of the released checkpoints (indices from
``num_hidden_layers`` on) are not run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..cache.kv import KVView
from .base import Model, apply_rope, attention, each_row, embedding, linear, rms_norm
from .batch import Batch, Span, spans_apply
from .decoder import GatedMLP, HybridBlock, rope_for
from .kimi_linear import LATENT_NORM_EPS, LatentMoEArgs, MoE, first_set, kda_chunked, kda_step, l2norm
from .rope_config import rope_params
from .ssm import causal_conv1d
from .tensors import fused_weight, param, stored, take, weight

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(kw_only=True)
class ModelArgs(LatentMoEArgs):
    moe_intermediate_size: int = 768
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-6
    routed_scaling_factor: float = 2.5
    topk_group: int | None = None
    first_k_dense_replace: int = 2
    layer_group_size: int = 6
    linear_head_dim: int | None = None
    linear_num_heads: int | None = None
    linear_conv_kernel_dim: int | None = None
    short_conv_kernel_size: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    # per layer, 0 = none: the routed experts' and the shared experts' SwiGLU clip
    expert_swiglu_limit_list: list | None = None
    share_expert_swiglu_limit_list: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.resolve_moe("Bailing hybrid", experts=512, groups=8, topk_group=4)
        # transformers' config turns ``head_dim`` into qk_rope_head_dim after copying it to
        # ``linear_head_dim``; a released config.json has only ``head_dim`` (the KDA head dim)
        self.linear_head_dim = first_set(self.linear_head_dim, self.head_dim)
        self.linear_num_heads = first_set(self.linear_num_heads, self.num_attention_heads)
        self.linear_conv_kernel_dim = first_set(self.linear_conv_kernel_dim, self.short_conv_kernel_size)
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [FULL if (i + 1) % self.layer_group_size == 0 else LINEAR for i in range(n)]


_RENAMES = [(re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
            (re.compile(r"\.attention\."), ".self_attn."),
            (re.compile(r"\.self_attn\.(f_proj\.|dt_bias$|A_log$)"), r".self_attn.forget_gate.\1"),
            (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
            (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias")]


def canonical_names(tensors: dict, layers: int) -> dict:
    """The released / save_pretrained names -> transformers' in-memory names (as its conversion
    mapping does), with the per-expert projections stacked into ``experts.gate_up_proj`` /
    ``experts.down_proj`` and q/k/v conv kernels concatenated into ``conv1d``. Tensors of layers
    from ``layers`` on (the MTP head) are dropped."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= layers:
            continue
        for pat, rep in _RENAMES:
            name = pat.sub(rep, name)
        out[name] = t
    for name in [n for n in out if n.endswith(".q_conv1d.weight")]:
        p = name[: -len(".q_conv1d.weight")]
        out[f"{p}.conv1d.weight"] = torch.cat([out.pop(f"{p}.{x}_conv1d.weight") for x in "qkv"])
    for name in [n for n in out if n.endswith(".experts.0.gate_proj.weight")]:
        p = name[: -len(".0.gate_proj.weight")]
        n_exp = 0
        while f"{p}.{n_exp}.gate_proj.weight" in out:
            n_exp += 1
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([out.pop(f"{p}.{e}.gate_proj.weight"),
                                                           out.pop(f"{p}.{e}.up_proj.weight")])
                                                for e in range(n_exp)])
        out[f"{p}.down_proj"] = torch.stack([out.pop(f"{p}.{e}.down_proj.weight") for e in range(n_exp)])
    return out


def deinterleave(w: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """Rows of ``w`` in groups of ``width`` whose last ``rope`` rows are interleaved pairs: reorder
    those to [evens | odds] in every group."""
    lead = w.shape[1:]
    g = w.reshape(-1, width, *lead)
    r = g[:, width - rope:]
    return torch.cat([g[:, :width - rope], r[:, 0::2], r[:, 1::2]], dim=1).reshape(w.shape)


# --- Kimi Delta Attention with the bounded forget gate ------------------------------------------------

class DeltaAttention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.h, self.d = a.linear_num_heads, a.linear_head_dim
        self.dim = self.h * self.d
        self.kernel = a.linear_conv_kernel_dim
        self.eps = a.rms_norm_eps
        self.safe, self.lower = a.kda_safe_gate, float(a.kda_lower_bound)
        w = lambda name: take(t, f"{p}.{name}.weight")   # noqa: E731
        # one matmul: q | k | v | forget gate | beta | output gate
        self.w_in = fused_weight([stored(t, f"{p}.{n}.weight") for n in ("q_proj", "k_proj", "v_proj",
                                  "forget_gate.f_proj", "b_proj", "g_proj")], dtype)
        # transformers keeps the conv, dt_bias and A_log in float32 in any dtype
        self.w_conv = param(w("conv1d").reshape(3 * self.dim, self.kernel), torch.float32)
        self.dt_bias = param(take(t, f"{p}.forget_gate.dt_bias").reshape(self.h, self.d), torch.float32)
        if f"{p}.forget_gate.exp_A_log" in t:   # llama.cpp's GGUF holds exp(A_log) itself (ssm_a)
            rate = take(t, f"{p}.forget_gate.exp_A_log").float()
        else:
            rate = take(t, f"{p}.forget_gate.A_log").float().exp()
        self.rate = param(rate.reshape(self.h, 1), torch.float32)
        self.w_norm = param(w("o_norm"), dtype)
        self.w_out = weight(stored(t, f"{p}.o_proj.weight"), dtype)

    def state_fields(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, 3 * self.dim), "recurrent": (self.h, self.d, self.d)}

    def forward(self, x, batch: Batch, i: int):
        N, H, D = x.shape[0], self.h, self.d
        qkv_all, f, b, gate = linear(x, self.w_in).split([3 * self.dim, self.dim, H, self.dim], dim=-1)
        f = f.float().view(N, H, D) + self.dt_bias
        g = self.lower * each_row(torch.sigmoid, self.rate * f) if self.safe else -self.rate * each_row(F.softplus, f)
        g_all = g.to(x.dtype).float().transpose(0, 1)                          # [H, N, D], rounded as transformers
        beta_all = each_row(torch.sigmoid, b).float().t()                                # [H, N]

        def one(s: Span):   # conv window and delta rule: this sequence's rows over its own state
            cache, T = s.caches[i], s.length
            qkv, conv_state = causal_conv1d(qkv_all[s.rows].float(), cache.state["conv"], self.w_conv, None)
            cache.set("conv", conv_state)
            q, k, v = each_row(F.silu, qkv).to(x.dtype).float().view(T, 3, H, D).permute(1, 2, 0, 3)   # each [H, T, D]
            q, k = l2norm(q) * D ** -0.5, l2norm(k)
            gs, beta, state = g_all[:, s.rows], beta_all[:, s.rows], cache.state["recurrent"]
            if T == 1:
                o, state = kda_step(q[:, 0], k[:, 0], v[:, 0], gs[:, 0], beta[:, 0], state)
                o = o[:, None]
            else:
                o, state = kda_chunked(q, k, v, gs, beta, state)
            cache.set("recurrent", state)
            cache.advance(T)
            return o.transpose(0, 1).to(x.dtype)                                  # [T, H, D]
        o = spans_apply(batch, one, i)
        # gated RMSNorm in float32: norm(o) * w * sigmoid(gate)
        o = rms_norm(o.float(), self.w_norm.float(), self.eps) * each_row(torch.sigmoid, gate.float()).view(N, H, D)
        return linear(o.to(x.dtype).reshape(N, self.dim), self.w_out)


# --- Multi-head Latent Attention with RoPE and a head gate ----------------------------------------------

class LatentAttention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, scale: float):
        super().__init__()
        self.h, self.R, self.r = a.num_attention_heads, a.kv_lora_rank, a.qk_rope_head_dim
        self.nope, self.dv = a.qk_nope_head_dim, a.v_head_dim
        self.dqk = self.nope + self.r
        self.scale = scale
        self.eps = LATENT_NORM_EPS
        self.half = -(-(self.R + self.r) // 2)          # the latent, split in two as the store's K and V
        bias = a.attention_bias
        self.q_lora = a.q_lora_rank is not None
        if self.q_lora:
            self.w_q_a = weight(stored(t, f"{p}.q_a_proj.weight"), dtype)
            self.b_q_a = param(take(t, f"{p}.q_a_proj.bias"), dtype) if bias else None
            self.ln_q_a = param(take(t, f"{p}.q_a_layernorm.weight"), dtype)
            self.w_q_b = param(deinterleave(take(t, f"{p}.q_b_proj.weight"), self.dqk, self.r), dtype)
        else:
            self.wq = param(deinterleave(take(t, f"{p}.q_proj.weight"), self.dqk, self.r), dtype)
        kv_a = self.R + self.r
        self.w_kv_a = param(deinterleave(take(t, f"{p}.kv_a_proj_with_mqa.weight"), kv_a, self.r), dtype)
        self.b_kv_a = (param(deinterleave(take(t, f"{p}.kv_a_proj_with_mqa.bias"), kv_a, self.r), dtype)
                       if bias else None)
        self.ln_kv_a = param(take(t, f"{p}.kv_a_layernorm.weight"), dtype)
        self.w_kv_b = weight(stored(t, f"{p}.kv_b_proj.weight"), dtype)
        self.w_gate = weight(stored(t, f"{p}.g_proj.weight"), dtype)
        self.wo = weight(stored(t, f"{p}.o_proj.weight"), dtype)
        self.bo = param(take(t, f"{p}.o_proj.bias"), dtype) if bias else None

    def cache_dims(self) -> tuple[int, int]:
        return 1, self.half

    def forward(self, x, batch: Batch, i: int, rope):
        N, H = x.shape[0], self.h
        cos, sin = rope
        if self.q_lora:
            q = linear(rms_norm(linear(x, self.w_q_a, self.b_q_a), self.ln_q_a, self.eps), self.w_q_b)
        else:
            q = linear(x, self.wq)
        q = q.view(N, H, self.dqk).transpose(0, 1)                              # [H, N, dqk]
        q = torch.cat([q[..., :self.nope], apply_rope(q[..., self.nope:], cos, sin)], dim=-1)
        c, k_rot = linear(x, self.w_kv_a, self.b_kv_a).split([self.R, self.r], dim=-1)
        latent = torch.cat([rms_norm(c, self.ln_kv_a, self.eps), apply_rope(k_rot, cos, sin)], dim=-1)
        if latent.shape[-1] < 2 * self.half:
            latent = F.pad(latent, (0, 2 * self.half - latent.shape[-1]))
        latent = latent.view(N, 2, self.half)
        width = max(self.dqk, self.dv)

        def one(s: Span):
            lat = latent[s.rows]
            view = s.caches[i].update_and_fetch(lat[None, :, 0], lat[None, :, 1])
            held = torch.cat([view.keys[0], view.values[0]], dim=-1)            # [S, 2 * half]
            S = held.shape[0]
            kv = linear(held[:, :self.R], self.w_kv_b).view(S, H, self.nope + self.dv).transpose(0, 1)
            keys = torch.cat([kv[..., :self.nope], held[:, self.R:self.R + self.r].expand(H, S, self.r)], dim=-1)
            values = kv[..., self.nope:]
            qs = q[:, s.rows]
            # the attention kernels take one head dim: zero-pad the narrower side (same dot products)
            if self.dqk < width:
                qs, keys = F.pad(qs, (0, width - self.dqk)), F.pad(keys, (0, width - self.dqk))
            if self.dv < width:
                values = F.pad(values, (0, width - self.dv))
            full = KVView(keys, values, view.key_pos0, view.query_pos0, view.queries, view.kind, view.span,
                          view.needed_from_many)
            return attention(qs, full, self.scale).view(s.length, H, width)[..., :self.dv]
        o = spans_apply(batch, one)                                               # [N, H, dv]
        gate = each_row(torch.sigmoid, linear(x, self.w_gate).float()).to(x.dtype)
        return linear((o * gate[..., None]).reshape(N, H * self.dv), self.wo, self.bo)


class Block(HybridBlock):
    rope_kinds = (FULL,)

    def __init__(self, a: ModelArgs, t: dict, i: int, dtype, scale: float):
        p = f"model.layers.{i}"
        mixers = {LINEAR: lambda: DeltaAttention(a, t, f"{p}.self_attn", dtype),
                  FULL: lambda: LatentAttention(a, t, f"{p}.self_attn", dtype, scale)}
        super().__init__(a, t, p, a.layer_types[i], dtype, mixers, "Bailing hybrid layer type")
        q = f"{p}.mlp"
        self.mlp = MoE(a, t, q, dtype) if a.mlp_layer_types[i] == "sparse" else GatedMLP.named(t, q, dtype)
        if isinstance(self.mlp, MoE):   # a dense layer's MLP is never clipped (transformers)
            routed, shared = (limits[i] if limits else 0 for limits in (a.expert_swiglu_limit_list,
                                                                         a.share_expert_swiglu_limit_list))
            for m in self.mlp.experts:
                m.limit = float(routed) if routed else None
            self.mlp.shared.limit = float(shared) if shared else None


class BailingHybridModel(Model):
    family = "bailing_hybrid"
    Args = ModelArgs
    packable_weights = ("w_in", "w_out", "wq", "w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_gate", "wo",
                        "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        t = canonical_names(tensors, args.num_hidden_layers)
        params = rope_params(config)
        self.rope = rope_for(params, args.qk_rope_head_dim, dtype)
        scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])   # DeepSeek's YaRN: the score scale takes mscale^2
            m = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = scale * m * m
        self.embed = weight(stored(t, "model.embed_tokens.weight"), dtype)
        self.layers = nn.ModuleList(Block(args, t, i, dtype, scale) for i in range(args.num_hidden_layers))
        self.norm = param(take(t, "model.norm.weight"), dtype)
        head = t.get("lm_head.weight")
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else weight(head, dtype)

    def cache_specs(self):
        out = []
        for layer in self.layers:
            if layer.kind == LINEAR:
                # float32 whatever the dtype, as transformers keeps it: a bfloat16 state rounded
                # between prefill chunks and decode steps drifts from the one-shot run
                out.append(specs.recurrent(state_dtype="float32", **layer.mixer.state_fields()))
            else:
                out.append(specs.full(*layer.mixer.cache_dims()))
        return out

    def forward(self, batch):
        return self.run_decoder(embedding(batch.tokens, self.embed, self.dtype), batch, self.rope.rows(batch))
