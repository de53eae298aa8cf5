"""gpt-oss: alternating sliding-window / full attention with attention sinks (a learned per-head
logit in every softmax denominator), biased q/k/v/o, YaRN RoPE, and a top-k MoE on every layer
(router with bias, softmax over the chosen logits, clamped SwiGLU experts with biases).

Expert weights come as save_pretrained writes them (``experts.gate_up_proj`` [E, hidden,
2 * intermediate] with gate and up interleaved by column, ``experts.down_proj`` [E, intermediate,
hidden], each with a bias) or as the released checkpoints store them, MXFP4 blocks + scales
(``*_blocks`` / ``*_scales``), which are dequantized to float once at load, exactly as
transformers' ``convert_moe_packed_tensors`` does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .batch import Batch
from .base import BaseArgs, apply_rope, attention_spans, each_row, linear, rowwise_linear
from .decoder import FULL, SLIDING, DecoderModel, PreNormBlock, out_weights, qkv_weights, rope_for
from .rope_config import rope_params
from .experts import RoutedExperts
from .tensors import MissingWeight, param, stored, take, weight

DEFAULT_THETA = 150_000.0

# the 16 values of an FP4 (e2m1) nibble, as transformers' integrations/mxfp4.py lists them
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_local_experts: int
    num_experts_per_tok: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = 128
    layer_types: list | None = None
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.layer_types:   # transformers' default: sliding, full, sliding, full, ...
            self.layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)]
        if self.sliding_window is None:
            self.layer_types = [FULL] * self.num_hidden_layers


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """MXFP4 -> float: ``blocks`` [E, rows, G, 16] uint8 (two FP4 values a byte, low nibble first),
    ``scales`` [E, rows, G] uint8 (a power of two per 32 values, exponent + 127). Returns
    [E, G * 32, rows], the layout of the float ``gate_up_proj`` / ``down_proj`` (input dim first)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    blocks = blocks.to(torch.uint8)
    *prefix, G, B = blocks.shape
    out = torch.empty(*prefix, G, B * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None])
    return out.reshape(*prefix, G * B * 2).transpose(1, 2).contiguous()


def expert_tensor(t: dict, name: str) -> torch.Tensor:
    """``name`` ([E, in, out]) from the float tensor, or from its MXFP4 blocks and scales."""
    if name in t:
        return take(t, name)
    if f"{name}_blocks" in t and f"{name}_scales" in t:
        return dequantize_mxfp4(t[f"{name}_blocks"], t[f"{name}_scales"])
    raise MissingWeight(f"checkpoint has no tensor {name!r} (nor {name}_blocks / {name}_scales)")


def expert_rows(t: dict, p: str):
    """(gate_up(e), down(e)): expert e's [2I, hidden] gate rows then up rows and its [hidden, I]
    down rows, from the GGUF's kept blocks (``gate_up_stack`` / ``down_stack``, already so) or
    from the float tensors (transformers' [E, in, out], gate and up interleaved by column)."""
    if f"{p}.gate_up_stack" in t:
        gate_up = stored(t, f"{p}.gate_up_stack").__getitem__
    else:
        gu = expert_tensor(t, f"{p}.gate_up_proj")                    # [E, hidden, 2I]
        gate_up = lambda e: torch.cat([gu[e].t()[0::2], gu[e].t()[1::2]])   # noqa: E731
    if f"{p}.down_stack" in t:
        return gate_up, stored(t, f"{p}.down_stack").__getitem__
    down = expert_tensor(t, f"{p}.down_proj")                           # [E, I, hidden]
    return gate_up, lambda e: down[e].t()


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, sliding: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.wqkv, self.bqkv = qkv_weights(t, p, dtype, a.attention_bias)
        self.wo, self.bo = out_weights(t, p, dtype, a.attention_bias)
        self.sinks = param(take(t, f"{p}.sinks"), dtype)

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = apply_rope(qkv[: hq + hk], *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        out = attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale, sinks=self.sinks)
        return linear(out, self.wo, self.bo)


class Expert(nn.Module):
    """One clamped SwiGLU expert: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g = clamp(gate, max)."""

    def __init__(self, wgu, bgu, wdown, bdown, alpha: float, limit: float, dtype):
        super().__init__()
        self.wgu, self.bgu = weight(wgu, dtype), param(bgu, dtype)
        self.wdown, self.bdown = weight(wdown, dtype), param(bdown, dtype)
        self.alpha, self.limit = alpha, limit

    def forward(self, x):
        gate, up = linear(x, self.wgu, self.bgu).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return linear((up + 1) * (gate * each_row(torch.sigmoid, gate * self.alpha)), self.wdown, self.bdown)


class MoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k = a.num_experts_per_tok
        self.w_router = param(take(t, f"{p}.router.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        self.b_router = param(take(t, f"{p}.router.bias"), dtype)
        gate_up, down = expert_rows(t, f"{p}.experts")
        gate_up_b = take(t, f"{p}.experts.gate_up_proj_bias")           # [E, 2I]
        down_b = take(t, f"{p}.experts.down_proj_bias")                 # [E, hidden]
        self.experts = RoutedExperts(
            Expert(gate_up(e), torch.cat([gate_up_b[e, 0::2], gate_up_b[e, 1::2]]), down(e), down_b[e],
                   a.swiglu_alpha, a.swiglu_limit, dtype) for e in range(a.num_local_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k]: the softmax over the chosen logits, experts [N, k])."""
        top, chosen = torch.topk(rowwise_linear(x, self.w_router, self.b_router), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen

    def forward(self, x):
        return self.experts.forward(x, *self.route(x))


class Block(PreNormBlock):
    def make_attention(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        return Attention(a, t, p, dtype, a.layer_types[i] == SLIDING)

    def make_mlp(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        return MoE(a, t, p, dtype)


class GptOssModel(DecoderModel):
    family = "gpt_oss"
    Args = ModelArgs
    Block = Block

    def set_rope(self, config: dict) -> None:
        params = dict(rope_params(config))
        if "rope_theta" not in (config.get("rope_parameters") or {}) and "rope_theta" not in config:
            params["rope_theta"] = DEFAULT_THETA
        self.rope = rope_for(params, self.args.head_dim, self.dtype)
