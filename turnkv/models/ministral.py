"""Ministral (``ministral``: Ministral 8B, sliding and full layers as ``layer_types`` says) and
Ministral 3 (``ministral3``: the text model of Ministral 3, one ``sliding_window`` for every layer
when set, YaRN RoPE and Llama-4-style query scaling by absolute position). Otherwise Llama:
pre-norm blocks, grouped-query attention, SiLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import apply_rope, attention_spans, embedding, linear
from .batch import Batch
from .decoder import FULL, SLIDING, DecoderArgs, DecoderModel, PreNormBlock, out_weights, qkv_weights, rope_for
from .fused import FusedSlot, fuse_llama_block
from .rope_config import rope_params


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    model_type: str
    sliding_window: int | None = None
    layer_types: list | None = None
    computes = {"hidden_act": ("silu",)}

    def __post_init__(self):
        super().__post_init__()
        # Ministral 3 windows every layer alike (transformers ignores layer_types there); Ministral
        # follows layer_types, which default to the window on every layer when one is set.
        if self.model_type == "ministral3" or not self.layer_types:
            self.layer_types = [SLIDING if self.sliding_window else FULL] * self.num_hidden_layers


def llama4_query_scale(positions: torch.Tensor, beta: float, original_max: int) -> torch.Tensor:
    """``1 + beta * log(1 + floor(pos / original_max))`` per row, as transformers computes it
    (float32): the query of a token is scaled by its absolute position."""
    return 1 + beta * torch.log(1 + torch.floor(positions / original_max))


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = self.d ** -0.5
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.wo, _ = out_weights(t, p, dtype)

    def forward(self, x, batch: Batch, i: int, rope, q_scale):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        qk = apply_rope(qkv[: hq + hk], *rope)
        q = qk[:hq] if q_scale is None else qk[:hq] * q_scale

        # every sequence's rows over its own KV (one native call for the batch)
        return linear(attention_spans(batch, i, q, qk[hq:], qkv[hq + hk:], self.scale), self.wo)


class Block(PreNormBlock):
    Attention = Attention

    fused = FusedSlot()     # its FusedBlock, or None

    def fuse(self) -> bool:
        """Run the block as two native calls (models/fused.py) when its weights allow it."""
        self.fused = fuse_llama_block(self)
        return self.fused is not None

    def forward(self, x, batch, i, rope, q_scale):
        f = self.fused
        if f is not None and f.takes(x):
            qk, v = f.qkv(x, rope)
            hq = self.attn.hq
            q = qk[:hq] if q_scale is None else qk[:hq] * q_scale
            return f.out_mlp(x, attention_spans(batch, i, q, qk[hq:], v, self.attn.scale))
        return super().forward(x, batch, i, rope, q_scale)


class MinistralModel(DecoderModel):
    family = "ministral"
    Args = ModelArgs
    Block = Block

    def set_rope(self, config: dict) -> None:
        params = rope_params(config)
        self.rope = rope_for(params, self.args.head_dim, self.dtype)
        beta = params.get("llama_4_scaling_beta") if self.args.model_type == "ministral3" else None
        self.q_scaling = (float(beta), int(params["original_max_position_embeddings"])) if beta else None

    def _query_scale(self, batch: Batch) -> torch.Tensor | None:
        if self.q_scaling is None:
            return None
        dev = batch.tokens.device
        positions = torch.cat([torch.arange(s.position, s.position + s.length, device=dev) for s in batch.spans])
        return llama4_query_scale(positions, *self.q_scaling).to(self.dtype)[:, None]

    def forward(self, batch):
        rope, q_scale = self.rope.rows(batch), self._query_scale(batch)
        return self.run_decoder(embedding(batch.tokens, self.embed, self.dtype), batch, rope, q_scale)
