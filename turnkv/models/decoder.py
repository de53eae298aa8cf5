"""The decoder skeleton the families share: the common config fields, the embedding / final norm /
lm_head, RoPE from a config, the gated MLP and the per-layer cache specs of a layer-type pattern.
A family imports what it uses; its attention and block stay its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..cache.specs import CacheSpec
from .base import BaseArgs, Rope, linear
from .rope_config import inv_freq_for
from .tensors import fused_weight, param, stored, take, weight

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(kw_only=True)
class DecoderArgs(BaseArgs):
    """The config fields every decoder family reads (transformers' names and defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


def embedding_and_head(tensors: dict, dtype: torch.dtype, tied: bool, prefix: str = "model."):
    """The embedding table and the lm_head (the same table when the checkpoint has no head or the
    config ties them), under HF's names."""
    embed = weight(stored(tensors, f"{prefix}embed_tokens.weight"), dtype)
    head = tensors.get("lm_head.weight")
    return embed, embed if head is None or tied else weight(head, dtype)


def decoder_weights(model: nn.Module, tensors: dict, args, dtype: torch.dtype, block,
                    norm: Callable[[torch.Tensor, torch.dtype], nn.Parameter] = param) -> None:
    """``model.embed``, ``model.layers`` (``block(args, tensors, i, dtype)``), ``model.norm`` (``norm``
    of the stored weight: Gemma's ``1 + w``, a float32 norm) and ``model.lm_head``."""
    model.embed, model.lm_head = embedding_and_head(tensors, dtype, args.tie_word_embeddings)
    model.layers = nn.ModuleList(block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
    model.norm = norm(take(tensors, "model.norm.weight"), dtype)


def qkv_weights(t: dict, p: str, dtype: torch.dtype, bias: bool = False):
    """``wqkv``, the q | k | v projections of ``{p}.{q,k,v}_proj`` as one fused weight, and their
    fused bias (None without ``bias``)."""
    w = fused_weight([stored(t, f"{p}.{n}_proj.weight") for n in "qkv"], dtype)
    return w, param(torch.cat([take(t, f"{p}.{n}_proj.bias") for n in "qkv"]), dtype) if bias else None


def out_weights(t: dict, p: str, dtype: torch.dtype, bias: bool = False):
    """``wo`` of ``{p}.o_proj`` and its bias (None without ``bias``)."""
    return weight(stored(t, f"{p}.o_proj.weight"), dtype), param(take(t, f"{p}.o_proj.bias"), dtype) if bias else None


def qk_norm_rows(t: dict, p: str, hq: int, hk: int) -> torch.Tensor:
    """``q_norm`` repeated over the query heads and ``k_norm`` over the kv heads, [hq + hk, 1, D]:
    q and k are normalized (and then rotated) together, one op each instead of two."""
    q = take(t, f"{p}.q_norm.weight")[None].expand(hq, -1)
    k = take(t, f"{p}.k_norm.weight")[None].expand(hk, -1)
    return torch.cat([q, k])[:, None]


def rope_for(params: dict, head_dim: int, dtype: torch.dtype, partial_rotary_factor: float = 1.0) -> Rope:
    """RoPE tables for ``params`` (``rope_config.rope_params`` of a config), as transformers
    computes them (scaling types, partial rotation)."""
    inv_freq, scaling = inv_freq_for(params, head_dim, partial_rotary_factor)
    return Rope(head_dim, 0.0, dtype, inv_freq=inv_freq, attention_scaling=scaling)


def attention_specs(layer_types: list[str], kv_heads: int, head_dim: int, window: int | None) -> list[CacheSpec]:
    """One cache spec per layer: a sliding window of ``window`` on ``SLIDING`` layers, full
    attention elsewhere."""
    return [specs.sliding(kv_heads, head_dim, window) if lt == SLIDING else specs.full(kv_heads, head_dim)
            for lt in layer_types]


def silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(x, approximate="tanh")


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one fused weight ``wgu`` (the names
    models/fused.py and the weight formats read). ``act`` runs in place on the fresh gate half: no
    extra [T, intermediate] allocations."""

    def __init__(self, gate_up: list, down, dtype: torch.dtype, act=silu_, biases: tuple | None = None):
        super().__init__()
        self.wgu, self.wdown = fused_weight(gate_up, dtype), weight(down, dtype)
        self.bgu = param(torch.cat(biases[0]), dtype) if biases else None
        self.bdown = param(biases[1], dtype) if biases else None
        self.act = act

    @classmethod
    def named(cls, t: dict, p: str, dtype: torch.dtype, act=silu_, bias: bool = False,
              names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> "GatedMLP":
        """From the checkpoint's ``{p}.{gate,up,down}.weight`` (and ``.bias`` with ``bias``)."""
        g, u, d = (f"{p}.{n}" for n in names)
        biases = ([take(t, f"{g}.bias"), take(t, f"{u}.bias")], take(t, f"{d}.bias")) if bias else None
        return cls([stored(t, f"{g}.weight"), stored(t, f"{u}.weight")], stored(t, f"{d}.weight"), dtype, act,
                   biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = linear(x, self.wgu, self.bgu).chunk(2, dim=-1)
        return linear(self.act(g).mul_(u), self.wdown, self.bdown)
