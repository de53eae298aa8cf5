"""EXAONE 4: sliding-window attention on local layers, full attention on the global ones (every
``sliding_window_pattern``-th, and as ``layer_types`` says), QK RMS-norm, post-norm residual
branches (no pre-norm), SiLU MLP. With a sliding window set, only the local layers use RoPE: the
global layers are NoPE; without one every layer is global and rotated."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import apply_rope, attention_spans, linear, rms_norm
from .batch import Batch
from .decoder import FULL, SLIDING, DecoderArgs, DecoderModel, GatedMLP, out_weights, qk_norm_rows, qkv_weights
from .tensors import param, take


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    sliding_window: int | None = 4096
    sliding_window_pattern: int | str | None = 4
    layer_types: list | None = None
    computes = {"hidden_act": ("silu",)}

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        elif not self.layer_types:
            self.layer_types = [self._pattern_type(i) for i in range(self.num_hidden_layers)]

    def _pattern_type(self, i: int) -> str:
        # transformers' rule for an int pattern; a "LLLG" string repeats, the last layer is global
        p = self.sliding_window_pattern
        if isinstance(p, str):
            if i == self.num_hidden_layers - 1:
                return FULL
            return FULL if p[i % len(p)].upper() == "G" else SLIDING
        return FULL if not p or (i + 1) % p == 0 else SLIDING


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, sliding: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        # NoPE global layers when the model has a window (transformers: ``sliding_window is None
        # or is_sliding``)
        self.rotate = a.sliding_window is None or sliding
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.wo, _ = out_weights(t, p, dtype)
        self.qk_norm = param(qk_norm_rows(t, p, self.hq, self.hk), dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = rms_norm(qkv[: hq + hk], None, self.eps).mul_(self.qk_norm)
        if self.rotate:
            qk = apply_rope(qk, *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale), self.wo)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.sliding = a.layer_types[i] == SLIDING
        self.ln_post_attn = param(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.ln_post_ff = param(take(t, f"{p}.post_feedforward_layernorm.weight"), dtype)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, self.sliding)
        self.mlp = GatedMLP.named(t, f"{p}.mlp", dtype)

    def forward(self, x, batch, i, rope):
        # post-norm branches: the attention and the MLP read the raw residual stream
        x += rms_norm(self.attn.forward(x, batch, i, rope), self.ln_post_attn, self.eps)
        x += rms_norm(self.mlp.forward(x), self.ln_post_ff, self.eps)
        return x


class Exaone4Model(DecoderModel):
    family = "exaone4"
    Args = ModelArgs
    Block = Block
