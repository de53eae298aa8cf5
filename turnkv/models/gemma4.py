"""Gemma 4 (text): per-layer sliding / full attention with per-layer head dims, KV sharing between
layers, per-layer embeddings (PLE), plain-weight RMS norms (q, k and a weightless v norm), a
proportional partial RoPE on the full layers, an optional MoE block beside the MLP, and a learned
per-layer output scalar.

KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V of their own; each reads the
K/V that the last earlier layer of its type (sliding or full) wrote in the same step, as
transformers' ``shared_kv_states`` does. So only the owning layers have a cache: ``cache_specs()``
lists one spec per *owning* layer (fewer entries than layers) and ``cache_of[i]`` maps a layer to
the cache it reads. A snapshot, a restore and the byte count therefore hold each shared K/V once,
and the truncation rule of the model is that of the owning caches (sliding / full, kv.py).

The shared layers write no state, so only the rows whose logits were asked for go through them
(transformers does the same in ``_maybe_slice_kv_shared_inputs``): a prefill chunk that wants no
logits stops after the last owning layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import specs
from ..cache.kv import KVView
from .batch import LAST, Batch, Span
from .base import BaseArgs, Model, Rope, apply_rope, attention, each_row, embedding, gelu_tanh, linear, rowwise_linear
from .decoder import FULL, SLIDING, GatedMLP, gelu_tanh_
from .experts import RoutedExperts
from .rope_config import inv_freq_for, rope_params
from .tensors import fused_weight, param, stored, take, weight

DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass
class ModelArgs(BaseArgs):
    # "vision" makes only image tokens attend both ways: the text decoder stays causal ("all" does not)
    computes = {"hidden_activation": ("gelu_pytorch_tanh", "gelu_tanh"), "use_bidirectional_attention": ("vision",)}
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    per_layer_config: dict | None = None
    use_bidirectional_attention: str | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
        self.layer_types = list(self.layer_types)
        self.layer_types[-1] = FULL                      # transformers forces the last layer global
        # per-layer head dim / kv heads: transformers 5.24 writes ``per_layer_config`` {layer: overrides};
        # older configs give ``global_head_dim`` / ``num_global_key_value_heads`` for the full layers
        self.head_dims = [self.head_dim] * n
        self.kv_heads = [self.num_key_value_heads] * n
        if self.per_layer_config is not None:
            for key, over in self.per_layer_config.items():
                key = str(key)   # a layer index, zero-padded to the widest ("05" of 12 layers), or a layer type
                for i in range(n):
                    if (key.isdigit() and int(key) == i) or key == self.layer_types[i]:
                        self.head_dims[i] = over.get("head_dim", self.head_dims[i])
                        self.kv_heads[i] = over.get("num_key_value_heads", self.kv_heads[i])
        else:
            for i in range(n):
                if self.layer_types[i] == FULL:
                    self.head_dims[i] = self.global_head_dim
                    if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                        self.kv_heads[i] = self.num_global_key_value_heads
        # KV sharing (transformers' ``kv_sharing_modes``): layers from ``first_shared`` on reuse the
        # K/V of the last earlier layer of their type
        self.first_shared = n - self.num_kv_shared_layers
        if self.num_kv_shared_layers and self.first_shared <= 0:
            raise ValueError("Gemma 4: every layer shares KV, so no layer computes it")
        self.producer = list(range(n))
        for i in range(self.first_shared, n):
            owners = [j for j in range(self.first_shared) if self.layer_types[j] == self.layer_types[i]]
            if not owners:
                raise ValueError(f"Gemma 4: no layer before {self.first_shared} of type {self.layer_types[i]}")
            self.producer[i] = owners[-1]


def norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm as transformers computes it: float32, ``x * pow(mean(x^2) + eps, -0.5) * w``
    (a plain weight, no ``1 + w``)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.to(x.dtype)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return each_row(gelu_tanh, x)


def _narrow(view: KVView, q0: int, n: int) -> KVView:
    """The producer's view for queries ``q0 .. q0+n-1`` only (the last ones of its call): drop keys
    no such query sees, so the view stays right also for a path that builds no mask (one query)."""
    if q0 == view.query_pos0 and n == view.queries:
        return view
    first = max(view.key_pos0, int(view.needed_from_many(torch.tensor([q0]))[0]))
    off = first - view.key_pos0
    return KVView(view.keys[:, off:], view.values[:, off:], first, q0, n, view.kind, view.span,
                  view.needed_from_many)


@dataclass(frozen=True, eq=False)
class Part:
    """A span's share of the rows a layer sees: rows ``[start, start + length)`` of ``x``, the
    first at absolute position ``position``."""

    span: Span
    start: int
    length: int
    position: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        super().__init__()
        self.kind = a.layer_types[i]
        self.hq, self.hk, self.d = a.num_attention_heads, a.kv_heads[i], a.head_dims[i]
        self.eps = a.rms_norm_eps
        self.shared = i >= a.first_shared
        self.k_eq_v = a.attention_k_eq_v and self.kind == FULL
        bias = a.attention_bias
        self.q_norm = param(take(t, f"{p}.q_norm.weight"), dtype)
        if self.shared:
            self.wq = weight(stored(t, f"{p}.q_proj.weight"), dtype)
            self.bq = param(take(t, f"{p}.q_proj.bias"), dtype) if bias else None
        else:
            names = ["q_proj", "k_proj"] + ([] if self.k_eq_v else ["v_proj"])
            self.wqkv = fused_weight([stored(t, f"{p}.{n}.weight") for n in names], dtype)
            self.bqkv = param(torch.cat([take(t, f"{p}.{n}.bias") for n in names]), dtype) if bias else None
            self.k_norm = param(take(t, f"{p}.k_norm.weight"), dtype)
        self.wo = weight(stored(t, f"{p}.o_proj.weight"), dtype)
        self.bo = param(take(t, f"{p}.o_proj.bias"), dtype) if bias else None

    def forward(self, x, parts: list[Part], cache: int, rope, views: dict):
        """``views`` maps (span, layer type) to the K/V view its owning layer produced this step."""
        hq, hk, d, N = self.hq, self.hk, self.d, x.shape[0]
        if self.shared:
            q = linear(x, self.wq, self.bq).view(N, hq, d)
        else:
            qkv = linear(x, self.wqkv, self.bqkv)
            q, k, v = qkv.split([hq * d, hk * d, 0 if self.k_eq_v else hk * d], dim=-1)
            q, k = q.view(N, hq, d), k.view(N, hk, d)
            v = k if self.k_eq_v else v.view(N, hk, d)     # k_eq_v: the raw key projection, v-normed
            k = apply_rope(norm(k, self.k_norm, self.eps).transpose(0, 1), *rope)
            v = norm(v, None, self.eps).transpose(0, 1)
        q = apply_rope(norm(q, self.q_norm, self.eps).transpose(0, 1), *rope)
        outs = []
        for part in parts:   # this sequence's rows over its own KV (or the owning layer's, shared)
            if self.shared:
                view = _narrow(views[(part.span, self.kind)], part.position, part.length)
            else:
                view = part.span.caches[cache].update_and_fetch(k[:, part.rows], v[:, part.rows])
                views[(part.span, self.kind)] = view
            outs.append(attention(q[:, part.rows], view, 1.0))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return linear(out, self.wo, self.bo)


class MoE(nn.Module):
    """The MoE block that runs beside the dense MLP: a router over the (un-normed) residual, a
    softmax over all experts, top-k renormalised and scaled per expert, GELU-tanh experts."""

    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k, self.eps, self.H = a.top_k_experts, a.rms_norm_eps, a.hidden_size
        self.w_router = param(take(t, f"{p}.router.proj.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        self.router_scale = param(take(t, f"{p}.router.scale"), dtype)
        self.per_expert_scale = param(take(t, f"{p}.router.per_expert_scale"), dtype)
        # float copies even from a GGUF's blocks, for now: on the Q8_0 fixture the exact Q8_0 weights
        # already put a third of the positions past test_gguf_families' tolerance, and the int8
        # activations of blocks move the one it checks from 0.097 to 0.123 of the largest logit
        # (docs/measurements/2026-12-06-moe-experts.md)
        gu, down = take(t, f"{p}.experts.gate_up_proj"), take(t, f"{p}.experts.down_proj")
        self.experts = RoutedExperts.gated(gu, down, dtype, gelu_tanh_)
        self.ln_pre = param(take(t, f"{p}.pre_feedforward_layernorm_2.weight"), dtype)

    def route(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k]) of the un-normed residual."""
        h = norm(residual, None, self.eps) * self.router_scale * self.H ** -0.5
        probs = torch.softmax(rowwise_linear(h, self.w_router), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen

    def forward(self, residual):
        return self.experts.forward(norm(residual, self.ln_pre, self.eps), *self.route(residual))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.kind = a.layer_types[i]
        w = lambda name: param(take(t, f"{p}.{name}.weight"), dtype)   # noqa: E731
        self.ln_in, self.ln_post_attn = w("input_layernorm"), w("post_attention_layernorm")
        self.ln_pre_ff, self.ln_post_ff = w("pre_feedforward_layernorm"), w("post_feedforward_layernorm")
        self.attn = Attention(a, t, f"{p}.self_attn", i, dtype)
        self.mlp = GatedMLP.named(t, f"{p}.mlp", dtype, gelu_tanh_)
        self.moe = None
        if a.enable_moe_block:
            self.moe = MoE(a, t, p, dtype)
            self.ln_post_ff1, self.ln_post_ff2 = w("post_feedforward_layernorm_1"), w("post_feedforward_layernorm_2")
        self.ple = bool(a.hidden_size_per_layer_input)
        if self.ple:
            self.w_ple_gate = weight(stored(t, f"{p}.per_layer_input_gate.weight"), dtype)
            self.w_ple_proj = weight(stored(t, f"{p}.per_layer_projection.weight"), dtype)
            self.ln_ple = w("post_per_layer_input_norm")
        scalar = t.get(f"{p}.layer_scalar")
        self.layer_scalar = param(scalar if scalar is not None else torch.ones(1), dtype)

    def forward(self, x, parts, cache, rope, views, ple_in):
        h = self.attn.forward(norm(x, self.ln_in, self.eps), parts, cache, rope, views)
        x = x + norm(h, self.ln_post_attn, self.eps)
        h = self.mlp.forward(norm(x, self.ln_pre_ff, self.eps))
        if self.moe is not None:
            h = norm(h, self.ln_post_ff1, self.eps) + norm(self.moe.forward(x), self.ln_post_ff2, self.eps)
        x = x + norm(h, self.ln_post_ff, self.eps)
        if self.ple:
            h = _gelu(linear(x, self.w_ple_gate)) * ple_in
            x = x + norm(linear(h, self.w_ple_proj), self.ln_ple, self.eps)
        return x * self.layer_scalar


def _rope(config: dict, layer_type: str, head_dim: int, dtype) -> Rope:
    params = dict(rope_params(config, layer_type)) if (config.get("rope_parameters") or {}).get(layer_type) \
        else dict(DEFAULT_ROPE[layer_type])
    if params.get("rope_type") == "proportional":
        # transformers' proportional RoPE: the first ``partial * head_dim / 2`` frequencies with
        # exponents over the whole head dim, zeros for the rest (those dims pass through unrotated)
        base, factor = float(params["rope_theta"]), float(params.get("factor", 1.0))
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / factor
        scaling = 1.0
    else:
        inv_freq, scaling = inv_freq_for(params, head_dim)
    return Rope(head_dim, 0.0, dtype, inv_freq=inv_freq, attention_scaling=scaling)


class Gemma4Model(Model):
    family = "gemma4"
    packable_weights = ("wqkv", "wq", "wo", "wgu", "wdown", "w_ple_gate", "w_ple_proj", "w_ple_model")
    head_weights = ("lm_head",)
    # the per-layer embedding table is only read by row (E2B's is 262k x 8960): a GGUF's stays in
    # its quantized blocks under ``--weights gguf``
    embedding_weights = ("embed", "embed_ple")

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        a = args
        self.args, self.dtype = a, dtype
        self.embed = weight(stored(tensors, "model.embed_tokens.weight"), dtype)
        self.embed_scale = torch.tensor(a.hidden_size ** 0.5).to(dtype)
        self.layers = nn.ModuleList(Block(a, tensors, i, dtype) for i in range(a.num_hidden_layers))
        self.norm = param(take(tensors, "model.norm.weight"), dtype)
        head = tensors.get("lm_head.weight")
        self.lm_head = self.embed if head is None or a.tie_word_embeddings else weight(head, dtype)
        self.P = a.hidden_size_per_layer_input
        if self.P:
            self.embed_ple = weight(stored(tensors, "model.embed_tokens_per_layer.weight"), dtype)
            self.ple_scale = torch.tensor(self.P ** 0.5).to(dtype)
            self.w_ple_model = weight(stored(tensors, "model.per_layer_model_projection.weight"), dtype)
            self.ln_ple_model = param(take(tensors, "model.per_layer_projection_norm.weight"), dtype)
        # one cache per owning layer; shared layers read their producer's
        owners = [i for i in range(a.num_hidden_layers) if i < a.first_shared]
        index = {layer: c for c, layer in enumerate(owners)}
        self.cache_of = [index[a.producer[i]] for i in range(a.num_hidden_layers)]
        self.ropes = {}
        for i, lt in enumerate(a.layer_types):
            key = (lt, a.head_dims[i])
            if key not in self.ropes:
                self.ropes[key] = _rope(config, lt, a.head_dims[i], dtype)

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        if isinstance(config.get("text_config"), dict):
            # a Gemma4ForConditionalGeneration folder (what Google releases): its text decoder
            # (vision and audio towers are not loaded here)
            text = dict(config["text_config"])
            text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
            prefix = "model.language_model."
            tensors = {"model." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)} | (
                {"lm_head.weight": tensors["lm_head.weight"]} if "lm_head.weight" in tensors else {})
            config = text
        return cls(ModelArgs.from_dict(config), config, tensors, dtype)

    def cache_specs(self):
        a = self.args
        return [specs.sliding(a.kv_heads[i], a.head_dims[i], a.sliding_window) if a.layer_types[i] == SLIDING
                else specs.full(a.kv_heads[i], a.head_dims[i]) for i in range(a.first_shared)]

    def _per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N, layers, P]: the token's own per-layer embedding plus a projection of its embedding."""
        L, P = self.args.num_hidden_layers, self.P
        ids = embedding(tokens, self.embed_ple, self.dtype) * self.ple_scale
        proj = linear(x, self.w_ple_model) * self.args.hidden_size ** -0.5
        proj = norm(proj.view(-1, L, P), self.ln_ple_model, self.args.rms_norm_eps)
        return (proj + ids.view(-1, L, P)) * 2.0 ** -0.5

    def forward(self, batch: Batch):
        a = self.args
        tables = {key: rope.rows(batch) for key, rope in self.ropes.items()}
        x = embedding(batch.tokens, self.embed, self.dtype) * self.embed_scale
        ple = self._per_layer_inputs(batch.tokens, x) if self.P else None
        parts = [Part(s, s.start, s.length, s.position) for s in batch.spans]
        views: dict = {}
        for i, layer in enumerate(self.layers):
            if i == a.first_shared:
                # the shared layers write no state: keep only the rows whose logits are wanted
                rows = batch.logit_rows()
                if rows is None:
                    return None
                x = x[rows]
                ple = ple[rows] if ple is not None else None
                tables = {k: (c[rows], s[rows]) for k, (c, s) in tables.items()}
                parts, r = [], 0
                for s in batch.spans:
                    n = s.logit_count()
                    if n:
                        parts.append(Part(s, r, n, s.position + (s.length - 1 if s.logits == LAST else 0)))
                        r += n
            x = layer.forward(x, parts, self.cache_of[i], tables[(layer.kind, a.head_dims[i])], views,
                              ple[:, i] if ple is not None else None)
        if a.first_shared == a.num_hidden_layers:
            rows = batch.logit_rows()
            if rows is None:
                return None
            x = x[rows]
        return self.head(x) if batch.head else x

    def head(self, x):
        a = self.args
        out = linear(norm(x, self.norm, a.rms_norm_eps), self.lm_head)
        cap = a.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

