"""Llama (SmolLM2 and friends), Qwen 2 and Qwen 3: full attention on every layer, fused QKV and
gate/up projections. Qwen 2 adds biases to q/k/v (not o); Qwen 3 RMS-norms every q and k head
before RoPE. Their sliding-window option (``use_sliding_window``, off in the released configs)
windows the layers transformers 5 does: those ``layer_types`` names, by default every layer from
``max_window_layers`` on (Qwen 3 MoE: every layer)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import apply_rope, attention_spans, embedding, linear, rms_norm
from .batch import Batch
from .decoder import (FULL, SLIDING, DecoderArgs, DecoderModel, GatedMLP, PreNormBlock, out_weights, qk_norm_rows,
                      qkv_weights)
from .fused import FusedSlot, NormHead, fuse_llama_block, stack_for
from .tensors import param


QWEN = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    # whole heads rotate (no partial rotary); Qwen 3's q/k norms come with its model_type
    computes = {"hidden_act": ("silu",), "partial_rotary_factor": (1, 1.0), "use_qk_norm": (False,)}
    model_type: str = "llama"
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list | None = None
    hidden_act: str = "silu"

    def __post_init__(self):
        super().__post_init__()
        t = self.model_type
        if t in QWEN and self.use_sliding_window and self.sliding_window:
            n, first = self.num_hidden_layers, 0 if t == "qwen3_moe" else self.max_window_layers
            self.layer_types = self.layer_types or [SLIDING if i >= first else FULL for i in range(n)]
        else:       # transformers drops the window (and so any sliding layer type) without the switch
            self.sliding_window, self.layer_types = None, None
        # Qwen 2's q/k/v carry biases its config does not name; its o_proj has none
        self.qkv_bias = self.attention_bias or t == "qwen2"
        self.o_bias = self.attention_bias
        self.qk_norm = t in ("qwen3", "qwen3_moe")


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.eps = a.rms_norm_eps
        self.wqkv, self.bqkv = qkv_weights(t, p, dtype, a.qkv_bias)
        self.wo, self.bo = out_weights(t, p, dtype, a.o_bias)
        self.qk_norm = param(qk_norm_rows(t, p, self.hq, self.hk), dtype) if a.qk_norm else None

    def forward(self, x, batch: Batch, i: int, rope):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv, self.bqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = qkv[: hq + hk]
        if self.qk_norm is not None:
            qk = rms_norm(qk, None, self.eps).mul_(self.qk_norm)
        qk = apply_rope(qk, *rope)
        # each sequence's rows over its own KV
        out = attention_spans(batch, i, qk[:hq], qk[hq:], qkv[hq + hk:], self.scale)
        return linear(out, self.wo, self.bo)


class Block(PreNormBlock):
    Attention = Attention

    def make_mlp(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        return GatedMLP.named(t, p, dtype, bias=a.mlp_bias)

    fused = FusedSlot()     # its FusedBlock, or None

    def fuse(self) -> bool:
        """Run the block as two native calls (models/fused.py) when its weights allow it."""
        self.fused = fuse_llama_block(self)
        return self.fused is not None

    def forward(self, x, batch, i, rope):
        f = self.fused
        if f is not None and f.takes(x):
            return f.layer(x, rope, batch, i, self.attn.scale)
        return super().forward(x, batch, i, rope)


class LlamaModel(DecoderModel):
    family = "llama"
    Args = ModelArgs
    Block = Block
    norm_head = None     # the final norm and lm_head as one native call (models/fused.py NormHead), or None

    def enable_fused(self) -> int:
        self.norm_head = NormHead.build(self.norm, self.args.rms_norm_eps, self.lm_head)
        return super().enable_fused()

    def head(self, x):
        f = self.norm_head
        if f is not None and f.takes(x):
            return f(x)
        return super().head(x)

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
