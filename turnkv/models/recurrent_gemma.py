"""RecurrentGemma (Griffin): RG-LRU recurrent blocks (conv1d state + LRU hidden state) interleaved
with local sliding-window attention, a biased GeGLU MLP, (1 + w) RMSNorms, sqrt(hidden)-scaled
embeddings and a tanh soft cap on the logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .batch import Batch, Span, spans_apply
from .base import BaseArgs, Model, attention_spans, each_row, gelu_tanh, linear, rms_norm
from .decoder import GatedMLP, HybridBlock, apply_partial_rope, gelu_tanh_, norm_plus_one, qkv_weights, rope_for
from .rope_config import rope_params
from .ssm import causal_conv1d, linear_recurrence
from .tensors import param, take

RECURRENT, ATTENTION = "recurrent", "attention"


@dataclass
class ModelArgs(BaseArgs):
    computes = {"hidden_activation": ("gelu_pytorch_tanh",)}
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    lru_width: int | None = None
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    block_types: list | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.lru_width = self.lru_width or self.hidden_size
        self.head_dim = self.hidden_size // self.num_attention_heads
        pattern = list(self.block_types or (RECURRENT, RECURRENT, ATTENTION))
        self.layer_kinds = [pattern[i % len(pattern)] for i in range(self.num_hidden_layers)]


class RGLRU(nn.Module):
    """Real-gated linear recurrent unit: h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)."""

    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.heads, self.width = a.num_attention_heads, a.lru_width
        self.block = self.width // self.heads
        # both gates are block-diagonal per head; one batched matmul computes them together
        self.w_gates = param(torch.cat([take(t, f"{p}.input_gate_weight"),
                                        take(t, f"{p}.recurrent_gate_weight")], dim=-1), dtype)
        self.b_gates = param(torch.cat([take(t, f"{p}.input_gate_bias"),
                                        take(t, f"{p}.recurrent_gate_bias")], dim=-1), dtype)
        self.log_a_scale = param(-8.0 * F.softplus(take(t, f"{p}.recurrent_param").float()), torch.float32)

    def forward(self, x: torch.Tensor, batch: Batch, i: int) -> torch.Tensor:
        """x [N, W] (conv outputs of every row); the gates over all rows, the recurrence per span
        from ``span.caches[i].state['rg_lru']``. Returns the outputs [N, W] float32."""
        N = x.shape[0]
        xh = x.view(N, self.heads, self.block).transpose(0, 1)                   # [heads, N, block]
        gates = torch.baddbmm(self.b_gates[:, None, :], xh, self.w_gates)       # [heads, N, 2 * block]
        gates = each_row(torch.sigmoid, gates).transpose(0, 1).reshape(N, self.heads, 2, self.block)
        input_gate = gates[:, :, 0].reshape(N, self.width)
        rec_gate = gates[:, :, 1].reshape(N, self.width)
        log_a = self.log_a_scale * rec_gate.float()
        multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
        for s in batch.spans:
            if s.position == 0:
                # the first token of a sequence resets the recurrence: no sqrt(1 - a^2)
                # normalisation (and no decay of history: the scan starts from zero below)
                multiplier[s.start] = 1.0
        normed = (x * input_gate) * multiplier.to(x.dtype)

        def one(s: Span):   # the recurrence: this sequence's rows over its own state
            h = s.caches[i].state["rg_lru"]
            out, h = linear_recurrence(log_a[s.rows], normed[s.rows], torch.zeros_like(h) if s.position == 0 else h)
            s.caches[i].set("rg_lru", h)
            return out
        return spans_apply(batch, one, i)


class RecurrentBlock(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.width, self.kernel = a.lru_width, a.conv1d_width
        self.w_yx = param(torch.cat([take(t, f"{p}.linear_y.weight"), take(t, f"{p}.linear_x.weight")]), dtype)
        self.b_yx = param(torch.cat([take(t, f"{p}.linear_y.bias"), take(t, f"{p}.linear_x.bias")]), dtype)
        self.w_out = param(take(t, f"{p}.linear_out.weight"), dtype)
        self.b_out = param(take(t, f"{p}.linear_out.bias"), dtype)
        self.w_conv = param(take(t, f"{p}.conv_1d.weight").reshape(self.width, self.kernel), dtype)
        self.b_conv = param(take(t, f"{p}.conv_1d.bias"), dtype)
        self.rg_lru = RGLRU(a, t, f"{p}.rg_lru", dtype)

    def state_fields(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, self.width), "rg_lru": (self.width,)}

    def forward(self, x, batch: Batch, i: int):
        y, xb_all = linear(x, self.w_yx, self.b_yx).split([self.width, self.width], dim=-1)

        def conv(s: Span):   # the conv window: this sequence's rows over its own state
            xb, conv_state = causal_conv1d(xb_all[s.rows], s.caches[i].state["conv"], self.w_conv, self.b_conv)
            s.caches[i].set("conv", conv_state)
            return xb
        h_all = self.rg_lru.forward(spans_apply(batch, conv, i), batch, i)
        for s in batch.spans:
            s.caches[i].advance(s.length)
        return linear(h_all.to(x.dtype) * each_row(gelu_tanh, y), self.w_out, self.b_out)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.bqkv = (param(torch.cat([take(t, f"{p}.q_proj.bias"), take(t, f"{p}.k_proj.bias"),
                                      take(t, f"{p}.v_proj.bias")]), dtype) if a.attention_bias else None)
        self.wo = param(take(t, f"{p}.o_proj.weight"), dtype)
        self.bo = param(take(t, f"{p}.o_proj.bias"), dtype)  # o_proj always has a bias

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = apply_partial_rope(qkv[: hq + hk], *rope)

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale), self.wo, self.bo)


class Block(HybridBlock):
    rope_kinds = (ATTENTION,)

    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        p = f"model.layers.{i}"
        mixers = {RECURRENT: lambda: RecurrentBlock(a, t, f"{p}.temporal_block", dtype),
                  ATTENTION: lambda: Attention(a, t, f"{p}.temporal_block", dtype)}
        super().__init__(a, t, p, a.layer_kinds[i], dtype, mixers, "RecurrentGemma block type", norm=norm_plus_one,
                         norms=("temporal_pre_norm", "channel_pre_norm"))
        self.mlp = GatedMLP.named(t, f"{p}.mlp_block", dtype, gelu_tanh_, bias=True)


class RecurrentGemmaModel(Model):
    family = "recurrent_gemma"
    Args = ModelArgs

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = param(take(tensors, "model.embed_tokens.weight"), dtype)
        # transformers keeps the sqrt(hidden) normalizer as a bfloat16 buffer: use the same rounding
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5, dtype=torch.bfloat16).to(dtype)
        self.layers = nn.ModuleList(Block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = norm_plus_one(take(tensors, "model.final_norm.weight"), dtype)
        head = tensors.get("lm_head.weight")
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else param(head, dtype)
        params = rope_params(config)
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
        self.rope = rope_for(params, args.head_dim, dtype, partial)

    def cache_specs(self):
        a = self.args
        return [specs.recurrent(**layer.mixer.state_fields()) if layer.kind == RECURRENT
                else specs.sliding(a.num_key_value_heads, a.head_dim, a.attention_window_size)
                for layer in self.layers]

    def forward(self, batch):
        rope = self.rope.rows(batch)
        x = F.embedding(batch.tokens, self.embed) * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)

    def head(self, x):
        out = linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)
        cap = self.args.logits_soft_cap
        return torch.tanh(out / cap) * cap
