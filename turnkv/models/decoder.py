"""The decoder skeleton the families share: the common config fields, the embedding / final norm /
lm_head, RoPE from a config, the gated MLP, the pre-norm block, the per-layer cache specs of a
layer-type pattern and ``DecoderModel``, the model class a dense family subclasses. A family imports
what it uses; its attention (and a block that is not ``PreNormBlock``) stay its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..cache.specs import CacheSpec
from .base import BaseArgs, Model, Rope, apply_rope, embedding, linear, rms_norm
from .rope_config import inv_freq_for, rope_params
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


def norm_plus_one(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """The weight of an RMSNorm that scales by ``1 + w`` (Gemma, Qwen3-Next), the 1 folded in once
    at load time."""
    return param(1.0 + t.float(), dtype)


def float32_norm(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """A norm weight kept in float32 whatever the model's dtype (transformers'
    ``_keep_in_fp32_modules``)."""
    return param(t, torch.float32)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head, the rest passed through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def rope_for(params: dict, head_dim: int, dtype: torch.dtype, partial_rotary_factor: float = 1.0) -> Rope:
    """RoPE tables for ``params`` (``rope_config.rope_params`` of a config), as transformers
    computes them (scaling types, partial rotation)."""
    inv_freq, scaling = inv_freq_for(params, head_dim, partial_rotary_factor)
    return Rope(head_dim, 0.0, dtype, inv_freq=inv_freq, attention_scaling=scaling)


def attention_specs(layer_types: list[str], kv_heads: int, head_dim: int, window: int | None) -> list[CacheSpec]:
    """One cache spec per layer: a sliding window of ``window`` on ``SLIDING`` layers, full
    attention elsewhere (and everywhere without a window)."""
    return [specs.sliding(kv_heads, head_dim, window) if lt == SLIDING and window else specs.full(kv_heads, head_dim)
            for lt in layer_types]


def silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(x, approximate="tanh")


# an elementwise call of at most this many values runs on one thread: ATen's GRAIN_SIZE is
# 32768, but its GeLU splits any call past 16384 values across the threads
ACT_GRAIN = 16384


def act_rows(act, g: torch.Tensor) -> torch.Tensor:
    """``act`` over ``g`` [..., I] in place, at most ``ACT_GRAIN`` values a call: blocks of whole
    rows, or ``ACT_GRAIN``-column pieces of longer rows. ATen splits a larger call across threads,
    and where a split falls inside a row, the values before it end in ATen's scalar tail, whose
    exp / tanh differ from the vector ones in the last bit for a few percent of inputs: a row's
    bits would depend on the rows computed with it and on the thread count (e.g. 2 threads, 1376
    columns, 47 rows). Each call here is one thread's loop over whole rows, as a row alone gets;
    the native layers (kernels/csrc/fused_layer.inc, ``act_rows``) cut the same blocks."""
    cols = g.shape[-1]
    if g.numel() <= ACT_GRAIN:
        return act(g)
    for block in g.view(-1, cols).split(max(1, ACT_GRAIN // cols)):
        for piece in block.split(ACT_GRAIN, dim=-1):
            out = act(piece)
            if out.data_ptr() != piece.data_ptr():
                piece.copy_(out)
    return g


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one fused weight ``wgu`` (the names
    models/fused.py and the weight formats read). ``act`` runs in place on the fresh gate half: no
    extra [T, intermediate] allocations. ``limit`` (Ling's SwiGLU clip): the activated gate is
    clamped to at most ``limit`` and the up half to [-limit, limit] before their product."""

    limit: float | None = None

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
        g = act_rows(self.act, g)
        if self.limit is not None:
            g, u = g.clamp_(max=self.limit), u.clamp(-self.limit, self.limit)
        return linear(g.mul_(u), self.wdown, self.bdown)


class PreNormBlock(nn.Module):
    """A decoder layer under HF's names with pre-norm residuals: ``x += attn(norm(x))``, then
    ``x += mlp(norm(x))``, both in place on the model's own residual buffer (fresh from the
    embedding). A family's block names its ``Attention`` class (built as ``Attention(args, tensors,
    prefix, dtype)``; ``make_attention`` where it takes more) and overrides ``make_mlp`` where the
    layer's MLP is not the plain gated one (a MoE on some layers, biases); ``forward``'s ``extra``
    arguments go to the attention."""

    Attention: ClassVar[type[nn.Module]]

    def __init__(self, a, t: dict, i: int, dtype: torch.dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.ln_attn = param(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_mlp = param(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.attn = self.make_attention(a, t, f"{p}.self_attn", i, dtype)
        self.mlp = self.make_mlp(a, t, f"{p}.mlp", i, dtype)

    def make_attention(self, a, t: dict, p: str, i: int, dtype: torch.dtype) -> nn.Module:
        return self.Attention(a, t, p, dtype)

    def make_mlp(self, a, t: dict, p: str, i: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP.named(t, p, dtype)

    def forward(self, x, batch, i, rope, *extra):
        x += self.attn.forward(rms_norm(x, self.ln_attn, self.eps), batch, i, rope, *extra)
        x += self.mlp.forward(rms_norm(x, self.ln_mlp, self.eps))
        return x


class HybridBlock(nn.Module):
    """A hybrid family's layer: its type ``kind`` picks the token mixer (``mixers[kind]()``; an
    unknown type is an error naming ``what``), between the pre-mixer norm ``ln_in`` and the pre-MLP
    norm ``ln_post`` (``norm`` of the stored weights); pre-norm residuals, ``x + mixer(norm(x))``
    then ``x + mlp(norm(x))``. The family sets ``mlp``; the mixers of ``rope_kinds`` take the RoPE rows."""

    rope_kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, a, t: dict, p: str, kind: str, dtype: torch.dtype, mixers: dict[str, Callable[[], nn.Module]],
                 what: str, norm=param, norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")):
        super().__init__()
        self.eps = a.rms_norm_eps
        self.kind = kind
        self.ln_in = norm(take(t, f"{p}.{norms[0]}.weight"), dtype)
        self.ln_post = norm(take(t, f"{p}.{norms[1]}.weight"), dtype)
        if kind not in mixers:
            raise ValueError(f"unknown {what} {kind!r}")
        self.mixer = mixers[kind]()

    def forward(self, x, batch, i, rope=None):
        h = rms_norm(x, self.ln_in, self.eps)
        h = self.mixer.forward(h, batch, i, rope) if self.kind in self.rope_kinds else self.mixer.forward(h, batch, i)
        x = x + h
        return x + self.mlp.forward(rms_norm(x, self.ln_post, self.eps))


class DecoderModel(Model):
    """A decoder family's model: ``Block(args, tensors, i, dtype)`` per layer under the skeleton's
    weight names (``decoder_weights``, the final norm through ``norm_weight``), one RoPE from the
    config (``set_rope``), a cache spec per layer from ``args.layer_types`` (every layer full
    attention without them) and the blocks over the token embeddings. A family sets ``family``,
    ``Args`` and ``Block`` and overrides what differs."""

    packable_weights = ("wqkv", "wo", "wgu", "wdown")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)
    Block: ClassVar[type[nn.Module]]
    norm_weight: ClassVar[Callable[[torch.Tensor, torch.dtype], nn.Parameter]] = staticmethod(param)

    def __init__(self, args: DecoderArgs, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        decoder_weights(self, tensors, args, dtype, self.Block, norm=self.norm_weight)
        self.set_rope(config)

    def set_rope(self, config: dict) -> None:
        """``self.rope`` from the config's RoPE parameters (a family with other defaults overrides)."""
        self.rope = rope_for(rope_params(config), self.args.head_dim, self.dtype)

    def cache_specs(self) -> list[CacheSpec]:
        a = self.args
        types = getattr(a, "layer_types", None) or [FULL] * a.num_hidden_layers
        return attention_specs(types, a.num_key_value_heads, a.head_dim, getattr(a, "sliding_window", None))

    def forward(self, batch):
        return self.run_decoder(embedding(batch.tokens, self.embed, self.dtype), batch, self.rope.rows(batch))
