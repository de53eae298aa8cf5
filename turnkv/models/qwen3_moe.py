"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder MoE): Qwen 3's attention (per-head q/k
RMS norms before RoPE; turnkv.models.llama) and, on every ``decoder_sparse_step``-th layer not in
``mlp_only_layers``, routed experts: a softmax over ``num_experts`` router logits, the top
``num_experts_per_tok`` kept (renormalized when ``norm_topk_prob``), no shared expert. Under the
gguf weights at float32 a decode step's layers run as Llama's fused native calls
(models/fused.py), the MoE layers' router and experts in them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .base import rowwise_linear
from .decoder import GatedMLP
from .experts import RoutedExperts, expert_stacks
from .llama import Block as LlamaBlock
from .llama import LlamaModel
from .llama import ModelArgs as QwenArgs
from .tensors import param, take


@dataclass(kw_only=True)
class ModelArgs(QwenArgs):
    model_type: str = "qwen3_moe"
    num_experts: int | None = None
    num_local_experts: int | None = None      # transformers 5 saves num_experts under this name
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        self.num_experts = self.num_local_experts or self.num_experts or 128

    def sparse(self, i: int) -> bool:
        # transformers' Qwen3MoeDecoderLayer rule
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class MoE(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype):
        super().__init__()
        self.top_k, self.norm_topk = a.num_experts_per_tok, a.norm_topk_prob
        self.w_router = param(take(t, f"{p}.gate.weight"), torch.float32)   # float32 once, as rowwise_linear runs
        self.experts = RoutedExperts.gated(*expert_stacks(t, p, a.num_experts), dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, experts [N, k]) as transformers' Qwen3MoeTopKRouter."""
        logits = rowwise_linear(x, self.w_router)   # the experts chosen for a row: never from its neighbours
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def forward(self, x):
        weights, chosen = self.route(x)
        return self.experts.forward(x, weights, chosen)


class Block(LlamaBlock):
    """Llama's block (its attention and fused calls) with a MoE layer for its MLP where ``sparse``."""

    def make_mlp(self, a: ModelArgs, t: dict, p: str, i: int, dtype):
        return MoE(a, t, p, dtype) if a.sparse(i) else GatedMLP.named(t, p, dtype)


class Qwen3MoeModel(LlamaModel):
    family = "qwen3_moe"
    Args = ModelArgs
    Block = Block
