"""The multi-token-prediction (MTP) block of Qwen3-Next / Qwen 3.5 checkpoints, run as a drafter
(docs/speculative.md, "MTP"). The checkpoint keeps it under ``mtp.*`` (transformers drops those
names at load: ``_keys_to_ignore_on_load_unexpected``; llama.cpp's converter writes them as the
block after the trunk, ``blk.{n}.*`` with ``blk.{n}.nextn.*``). Its formula, as vLLM's
qwen3_5_mtp.py / qwen3_next_mtp.py and llama.cpp's ``graph_mtp`` (src/models/qwen35.cpp) run it:

    e_i   = RMSNorm_(1+w)(embed(t_{i+1}); pre_fc_norm_embedding)
    h_i   = RMSNorm_(1+w)(H_i; pre_fc_norm_hidden)        H_i: the trunk's hidden state at
                                                          position i after its final norm
    z_i   = fc([e_i | h_i])                               [hidden, 2 * hidden], no bias
    z_i   = one full-attention decoder layer (the trunk's layer class, at position i, over the
            block's own K/V of positions <= i)
    out_i = RMSNorm_(1+w)(z_i; mtp.norm)                  logits_i = lm_head(out_i): a draft of t_{i+2}

A chained draft feeds ``out_i`` back as the next position's ``H``, with the token just drafted."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..cache.kv import KVCache
from .base import embedding, linear, rms_norm
from .batch import ALL, Batch, Span
from .decoder import norm_plus_one
from .tensors import stored, take, weight

PREFIX = "mtp."
LAYER = "mtp.layers.0."


def has_mtp(tensors: dict) -> bool:
    return f"{PREFIX}fc.weight" in tensors


class MtpHead(nn.Module):
    """One MTP block over the trunk's embedding, RoPE and lm_head (``trunk``, not held as a
    submodule: the block's weights are its own, the shared ones the trunk's)."""

    def __init__(self, trunk, tensors: dict, dtype: torch.dtype, block_class, full_kind: str):
        super().__init__()
        a = trunk.args
        self.eps, self.dtype = a.rms_norm_eps, dtype
        self.heads, self.head_dim = a.num_key_value_heads, a.head_dim
        self.pre_e = norm_plus_one(take(tensors, f"{PREFIX}pre_fc_norm_embedding.weight"), dtype)
        self.pre_h = norm_plus_one(take(tensors, f"{PREFIX}pre_fc_norm_hidden.weight"), dtype)
        self.eh_proj = weight(stored(tensors, f"{PREFIX}fc.weight"), dtype)    # llama.cpp's name
        self.norm = norm_plus_one(take(tensors, f"{PREFIX}norm.weight"), dtype)
        # the trunk's layer class, built as one more full-attention layer from the block's tensors
        n = a.num_hidden_layers
        args = copy.copy(a)
        args.layer_types = [*a.layer_types, full_kind]
        named = {f"model.layers.{n}.{k[len(LAYER):]}": v for k, v in tensors.items() if k.startswith(LAYER)}
        self.block = block_class(args, named, n, dtype)

    def new_cache(self, mode: str, device="cpu") -> KVCache:
        """The block's own K/V for one sequence."""
        return KVCache(self.heads, self.head_dim, self.dtype, device, mode)

    @torch.inference_mode()
    def forward(self, trunk, tokens: torch.Tensor, hidden: torch.Tensor, position: int,
                cache: KVCache) -> torch.Tensor:
        """``out`` [T, hidden] for rows ``i = position ..`` of one sequence: ``tokens`` [T] are
        t_{i+1}, ``hidden`` [T, hidden] the H_i (the trunk's, after its final norm, or a chained
        ``out``). Appends the rows' K/V to ``cache`` (whose offset may run behind ``position``:
        the block attends over the positions it was given, RoPE at the true ones)."""
        e = rms_norm(embedding(tokens, trunk.embed, self.dtype), self.pre_e, self.eps)
        h = rms_norm(hidden.to(self.dtype), self.pre_h, self.eps)
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)
        batch = Batch(tokens, (Span((cache,), 0, len(tokens), position, ALL),), head=False)
        x = self.block.forward(x, batch, 0, trunk.rope.rows(batch))
        return rms_norm(x, self.norm, self.eps)

    def logits(self, trunk, out: torch.Tensor) -> torch.Tensor:
        return linear(out, trunk.lm_head)
