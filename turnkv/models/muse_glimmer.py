"""Muse Glimmer (transformers' ``muse_glimmer``, MuseGlimmerForConditionalGeneration): the text
decoder only (the vision tower, adapter and projection are not loaded; images are the multimodal
issue's). transformers has no text-only CausalLM for it: its conditional-generation model's text
path (``model.language_model`` + ``lm_head``) is the oracle.

The decoder: sliding-window attention on most layers and full attention on every fourth counted
back from the last (``layer_types``); RoPE on the layers whose ``layer_rope_theta`` is non-zero
(by default the sliding ones; the full ones are NoPE). Every attention normalises q and k per head
with a weightless RMS norm, multiplies q by ``qk_scale_factor`` (scores still scale by
``head_dim^-0.5``), and gates its output with ``sigmoid(gate_proj(x))`` before ``o_proj``. Gemma 2's
four ``(1 + w)`` norms per block (the two post norms with ``post_norm_eps``), a gated MLP
(``hidden_activation``), a weightless RMS norm on the embeddings (no ``sqrt(hidden)`` scale), a
plain-weight final norm, and logits ``tanh(lm_head(x) * output_multiplier / cap) * cap``.

State per layer (``cache_specs()``): ``sliding(window=sliding_window)`` on the sliding layers,
``full`` on the others; both existing kinds, with their existing truncation rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseArgs, apply_rope, attention_spans, each_row, embedding, linear
from .decoder import FULL, SLIDING, DecoderModel, GatedMLP, float32_norm, gelu_tanh_, out_weights, silu_
from .tensors import fused_weight, param, stored, take

PREFIX = "model.language_model."
ACTIVATIONS = {"silu": silu_, "gelu_pytorch_tanh": gelu_tanh_}


@dataclass
class ModelArgs(BaseArgs):
    computes = {"hidden_activation": tuple(ACTIVATIONS)}
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    sliding_window: int | None = 2048
    layer_types: list | None = None
    layer_rope_theta: list | None = None
    hidden_activation: str = "silu"
    attention_bias: bool = False
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    final_logit_softcapping: float | None = 20.0
    tie_word_embeddings: bool = False
    image_token_id: int | None = None      # from the outer config: embedded as token 0 (no images here)
    video_token_id: int | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.layer_types:
            self.layer_types = [FULL if (n - 1 - i) % 4 == 0 else SLIDING for i in range(n)]
        if self.sliding_window is None:
            self.layer_types = [FULL] * n
        if self.layer_rope_theta is None:
            # transformers: 0 (NoPE) every 4th layer counted back from the last, else the global theta
            self.layer_rope_theta = [0 if (n - 1 - i) % 4 == 0 else 1 for i in range(n)]


def text_part(config: dict, tensors: dict) -> tuple[dict, dict]:
    """The text decoder's config (``text_config``, with the outer image / video token ids and tie
    flag) and its tensors renamed from ``model.language_model.*`` to ``model.*``; the vision tower's are dropped."""
    text = dict(config.get("text_config") or config)
    if "text_config" in config:
        # transformers ties lm_head to the embeddings by the outer config's flag, not text_config's
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings"))
    for key in ("image_token_id", "video_token_id"):
        if key in config:
            text.setdefault(key, config[key])
    renamed = {}
    for name, t in tensors.items():
        if name.startswith(PREFIX):
            renamed["model." + name[len(PREFIX):]] = t
        elif name == "lm_head.weight" or name.startswith("model.layers.") or name in ("model.embed_tokens.weight",
                                                                                       "model.norm.weight"):
            renamed[name] = t
    return text, renamed


def unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' weightless MuseGlimmerRMSNorm: ``x * pow(mean(x^2) + eps, -0.5)`` in float32."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def centered_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 2's norm: float32 ``rms_norm(x) * (1 + w)`` (``w1`` holds ``1 + w`` in float32)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w1, eps).to(x.dtype)


def _plus_one(w: torch.Tensor) -> nn.Parameter:
    return param(1.0 + w.float(), torch.float32)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, rotate: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps, self.q_mult, self.rotate = a.rms_norm_eps, a.qk_scale_factor, rotate
        names = ("q_proj", "k_proj", "v_proj", "gate_proj")
        self.w_in = fused_weight([stored(t, f"{p}.{n}.weight") for n in names], dtype)
        if a.attention_bias:   # gate_proj has no bias
            gate_zero = torch.zeros(self.hq * self.d)
            self.b_in = param(torch.cat([take(t, f"{p}.{n}.bias") for n in names[:3]] + [gate_zero]), dtype)
        else:
            self.b_in = None
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)

    def forward(self, x, batch, i: int, rope):
        N, hq, hk, d = x.shape[0], self.hq, self.hk, self.d
        qkv, gate = linear(x, self.w_in, self.b_in).split([(hq + 2 * hk) * d, hq * d], dim=-1)
        qkv = qkv.view(N, hq + 2 * hk, d).transpose(0, 1)
        q = unit_norm(qkv[:hq], self.eps) * self.q_mult
        k = unit_norm(qkv[hq:hq + hk], self.eps)
        if self.rotate:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = attention_spans(batch, i, q, k, qkv[hq + hk:], self.scale)
        return linear(o * each_row(torch.sigmoid, gate), self.wo, self.bo)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps, self.post_eps = a.rms_norm_eps, a.post_norm_eps
        self.sliding = a.layer_types[i] == SLIDING
        norm = lambda name: _plus_one(take(t, f"{p}.{name}.weight"))   # noqa: E731
        self.ln_in, self.ln_post_attn = norm("input_layernorm"), norm("post_attention_layernorm")
        self.ln_pre_ff, self.ln_post_ff = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, rotate=bool(a.layer_rope_theta[i]))
        self.mlp = GatedMLP.named(t, f"{p}.mlp", dtype, ACTIVATIONS[a.hidden_activation])

    def forward(self, x, batch, i, rope):
        h = self.attn.forward(centered_norm(x, self.ln_in, self.eps), batch, i, rope)
        x = x + centered_norm(h, self.ln_post_attn, self.post_eps)
        h = self.mlp.forward(centered_norm(x, self.ln_pre_ff, self.eps))
        return x + centered_norm(h, self.ln_post_ff, self.post_eps)


class MuseGlimmerModel(DecoderModel):
    """One rotary table (the skeleton's) for every rotated layer, as transformers: a non-zero
    ``layer_rope_theta`` only switches RoPE on; the frequencies come from rope_parameters."""

    family = "muse_glimmer"
    Block = Block
    packable_weights = ("w_in", "wo", "wgu", "wdown")
    norm_weight = staticmethod(float32_norm)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__(args, config, tensors, dtype)
        self.media_ids = [m for m in (args.image_token_id, args.video_token_id) if m is not None]

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        text, tensors = text_part(config, tensors)
        return cls(ModelArgs.from_dict(text), text, tensors, dtype)

    def forward(self, batch):
        rope = self.rope.rows(batch)
        tokens = batch.tokens
        for m in self.media_ids:   # transformers embeds image / video placeholders as token 0
            tokens = tokens.masked_fill(tokens == m, 0)
        x = unit_norm(embedding(tokens, self.embed, self.dtype), self.args.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)

    def head(self, x):
        x = (x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + self.args.rms_norm_eps, -0.5)
             * self.norm).to(x.dtype)
        logits = linear(x, self.lm_head)
        cap = self.args.final_logit_softcapping
        logits = logits * self.args.output_multiplier
        return torch.tanh(logits / cap) * cap if cap else logits
