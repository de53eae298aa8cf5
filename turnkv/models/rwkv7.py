"""RWKV-7 ("x070", Goose): no attention at all. Every layer is a time-mix (the generalized delta rule
on a per-head matrix state, with a data-dependent per-channel decay, an in-context learning rate and
the value residual from the first layer) followed by a channel-mix (squared-ReLU feed-forward);
both read the previous token through a token shift.

State per layer (one recurrent cache, restorable at its own length only): ``wkv [heads, head_dim,
head_dim]`` in the reference's [key, value] layout, held in float32 as the reference holds it, and
the two shift states ``att_shift`` / ``ffn_shift [hidden]``: the last token's normalized input of
each mix.

Weights are read in the fla-hub layout (``RWKV7ForCausalLM``: ``model.layers.N.attn.{r,k,v,o}_proj``,
``{w,a,g,v}_lora.lora.{0,2}``, ``x_{r,w,k,v,a,g}``, ``k_k``, ``k_a``, ``r_k``, ``g_norm``; ``ffn.key``
/ ``ffn.value`` / ``ffn.x_k``), the layout rwkv7-hf and flash-linear-attention save and llama.cpp's
converter reads.

Under ``--weights gguf`` every matrix the file stores quantized (the time-mix r/k/v/o, the
channel-mix key/value, the head and the embedding table; the low-rank projections where the file
quantized them: llama-quantize leaves them in float, the converter's ``q8_0`` does not) runs on the
GGUF's own blocks through ``linear`` / ``embedding``, row-wise kernels whose bits do not depend on
the chunk or the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .base import BaseArgs, Model, each_row, embedding, linear, rowwise_linear
from .batch import Batch, Span, spans_apply
from .gguf_weights import GGUFPacked
from .packed import PackedWeight
from .tensors import param, stored, take, weight

DECAY_SCALE = math.exp(-0.5)      # w = exp(-e^-0.5 * sigmoid(w0 + lora)), as the reference writes it
MIXES = "rwkvag"                  # the six token-shift interpolations of the time-mix, in this order


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    head_dim: int | None = None
    num_heads: int | None = None
    norm_eps: float = 1e-5
    norm_bias: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads if self.num_heads else 64
        self.num_heads = self.hidden_size // self.head_dim


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def shifted(x: torch.Tensor, batch: Batch, i: int, name: str) -> torch.Tensor:
    """Each row's previous token (``x`` rows of the same span, the span's first row from the cache's
    ``name`` state), and the span's last row written back as the new state."""
    def one(s: Span) -> torch.Tensor:
        cache, rows = s.caches[i], x[s.rows]
        prev = torch.cat([cache.state[name].to(x.dtype)[None], rows[:-1]])
        cache.set(name, rows[-1])
        return prev
    return spans_apply(batch, one, i)


def wkv7(r, w, k, v, a, b, state):
    """The RWKV-7 recurrence, token by token, per head. In the [value, key] layout the reference
    evaluates: ``S <- S diag(w_t) + (S a_t) b_t^T + v_t k_t^T``, ``y_t = S r_t``.

    r, w, k, v, a, b [T, H, D]; state [H, D(key), D(value)]. Returns (y [T, H, D] float32, final state
    in the [key, value] layout, float32)."""
    r, w, k, v, a, b = (t.float() for t in (r, w, k, v, a, b))
    S = state.float().transpose(-1, -2)
    out = torch.empty_like(v)
    for t in range(r.shape[0]):
        S = (S * w[t, :, None, :] + torch.matmul(S, a[t, :, :, None]) * b[t, :, None, :]
             + v[t, :, :, None] * k[t, :, None, :])
        out[t] = torch.matmul(S, r[t, :, :, None])[..., 0]
    return out, S.transpose(-1, -2)


def lora(t: dict, p: str, dtype, bias: bool):
    """``{p}.lora.0`` (down) and ``{p}.lora.2`` (up, with its bias when ``bias``)."""
    down, up = weight(stored(t, f"{p}.lora.0.weight"), dtype), weight(stored(t, f"{p}.lora.2.weight"), dtype)
    return down, up, (param(take(t, f"{p}.lora.2.bias"), dtype) if bias else None)


class RowByRow(PackedWeight):
    """A float matrix of a model whose other matrices run on GGUF blocks (llama.cpp keeps RWKV-7's
    decay LoRA F32 in every file), multiplied by ``rowwise_linear``: every output in one fixed
    order, whatever the rows beside it. A GEMM's blocking rounds a row differently with other rows
    beside it; the GGUF kernels do not, so with this the model's rows are the same bits whatever
    the chunk or the batch (reuse, drafts). Only these small low-rank matrices are stored so."""

    def __init__(self, w: nn.Parameter):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.w = w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(x, self.w)


class TimeMix(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, first: bool, dtype):
        super().__init__()
        self.H, self.D, self.first = a.num_heads, a.head_dim, first
        self.mix = param(torch.stack([take(t, f"{p}.x_{n}").reshape(-1) for n in MIXES]), dtype)   # [6, C]
        self.wr, self.wk, self.wv, self.wo = (weight(stored(t, f"{p}.{n}_proj.weight"), dtype) for n in "rkvo")
        self.w1, self.w2, _ = lora(t, f"{p}.w_lora", dtype, bias=False)
        self.w0 = param(take(t, f"{p}.w_lora.lora.2.bias"), torch.float32)    # the reference adds it in float32
        self.a1, self.a2, self.a0 = lora(t, f"{p}.a_lora", dtype, bias=True)
        self.g1, self.g2, _ = lora(t, f"{p}.g_lora", dtype, bias=False)
        # layer 0's value is the residual every later layer mixes in; some checkpoints carry an
        # unused v_lora there too
        self.v1, self.v2, self.v0 = (None, None, None) if first else lora(t, f"{p}.v_lora", dtype, bias=True)
        self.k_k, self.k_a = (param(take(t, f"{p}.{n}").reshape(-1), dtype) for n in ("k_k", "k_a"))
        self.r_k = param(take(t, f"{p}.r_k").reshape(self.H, self.D), dtype)
        self.ln_w, self.ln_b = param(take(t, f"{p}.g_norm.weight"), dtype), param(take(t, f"{p}.g_norm.bias"), dtype)
        self.ln_eps = self.D * a.norm_eps

    def forward(self, x: torch.Tensor, batch: Batch, i: int, v_first: torch.Tensor | None):
        N, H, D = x.shape[0], self.H, self.D
        delta = shifted(x, batch, i, "att_shift") - x
        xr, xw, xk, xv, xa, xg = (x + delta * m for m in self.mix)
        r, k, v = linear(xr, self.wr), linear(xk, self.wk), linear(xv, self.wv)
        raw = linear(each_row(torch.tanh, linear(xw, self.w1)), self.w2)
        w = each_row(torch.exp, -DECAY_SCALE * each_row(torch.sigmoid, raw.float() + self.w0))
        iclr = each_row(torch.sigmoid, linear(linear(xa, self.a1), self.a2, self.a0))
        g = linear(each_row(torch.sigmoid, linear(xg, self.g1)), self.g2)
        kk = F.normalize((k * self.k_k).view(N, H, D), dim=-1)
        k = k * (1 + (iclr - 1) * self.k_a)
        if self.first:
            v_first = v
        else:
            v = v + (v_first - v) * each_row(torch.sigmoid, linear(linear(xv, self.v1), self.v2, self.v0))
        heads = [t.view(N, H, D) for t in (r, w, k, v)]
        b = kk * iclr.view(N, H, D)

        def one(s: Span) -> torch.Tensor:
            cache = s.caches[i]
            y, state = wkv7(*(t[s.rows] for t in heads), -kk[s.rows], b[s.rows], cache.state["wkv"])
            cache.set("wkv", state)
            return y
        y = spans_apply(batch, one, i).to(x.dtype).reshape(N, H * D)
        y = F.group_norm(y, H, self.ln_w, self.ln_b, self.ln_eps).view(N, H, D)
        direct = (heads[0] * heads[2] * self.r_k).sum(-1, keepdim=True) * heads[3]
        return linear((y + direct).reshape(N, H * D) * g, self.wo), v_first


class ChannelMix(nn.Module):
    def __init__(self, t: dict, p: str, dtype):
        super().__init__()
        self.x_k = param(take(t, f"{p}.x_k").reshape(-1), dtype)
        self.wk, self.wv = weight(stored(t, f"{p}.key.weight"), dtype), weight(stored(t, f"{p}.value.weight"), dtype)

    def forward(self, x: torch.Tensor, batch: Batch, i: int) -> torch.Tensor:
        xk = x + (shifted(x, batch, i, "ffn_shift") - x) * self.x_k
        return linear(torch.relu(linear(xk, self.wk)).square(), self.wv)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p, self.eps = f"model.layers.{i}", a.norm_eps
        norm = (lambda n: (param(take(t, f"{p}.{n}.weight"), dtype),
                           param(take(t, f"{p}.{n}.bias"), dtype) if a.norm_bias else None))
        self.pre = norm("pre_norm") if i == 0 else None
        self.ln1, self.ln2 = norm("attn_norm"), norm("ffn_norm")
        self.attn = TimeMix(a, t, f"{p}.attn", i == 0, dtype)
        self.ffn = ChannelMix(t, f"{p}.ffn", dtype)

    def forward(self, x, batch: Batch, i: int, v_first):
        if self.pre is not None:
            x = layer_norm(x, *self.pre, self.eps)
        h, v_first = self.attn.forward(layer_norm(x, *self.ln1, self.eps), batch, i, v_first)
        x = x + h
        x = x + self.ffn.forward(layer_norm(x, *self.ln2, self.eps), batch, i)
        for s in batch.spans:
            s.caches[i].advance(s.length)
        return x, v_first


class Rwkv7Model(Model):
    family = "rwkv7"
    packable_weights = ("wr", "wk", "wv", "wo")        # the channel-mix key / value too (wk, wv)
    # llama.cpp keeps the low-rank projections in float (llama-quantize skips time_mix_{w,a,g,v}{1,2}):
    # the packing formats leave them float too; a GGUF that stores them quantized runs its blocks
    gguf_only_weights = ("w1", "w2", "a1", "a2", "g1", "g2", "v1", "v2")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args: ModelArgs, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = weight(stored(tensors, "model.embeddings.weight"), dtype)
        self.layers = nn.ModuleList(Block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = param(take(tensors, "model.norm.weight"), dtype)
        self.norm_b = param(take(tensors, "model.norm.bias"), dtype) if args.norm_bias else None
        tied = "lm_head.weight" not in tensors or args.tie_word_embeddings
        self.lm_head = self.embed if tied else weight(stored(tensors, "lm_head.weight"), dtype)
        if any(isinstance(m, GGUFPacked) for m in self.modules()):
            self._float_rows_alone()

    def _float_rows_alone(self) -> None:
        """Under the gguf weights, every matmul weight the file stores in float runs ``RowByRow``."""
        names = set(self.packable_weights) | set(self.gguf_only_weights) | set(self.head_weights)
        for m in self.modules():
            for n in names & set(m._parameters):
                w = m._parameters.pop(n)
                if w is not None:
                    setattr(m, n, RowByRow(w))

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(ModelArgs.from_dict(config), tensors, dtype)

    def cache_specs(self):
        a = self.args
        fields = {"wkv": (a.num_heads, a.head_dim, a.head_dim), "att_shift": (a.hidden_size,),
                  "ffn_shift": (a.hidden_size,)}
        return [specs.recurrent(state_dtype="float32", **fields) for _ in range(a.num_hidden_layers)]

    def forward(self, batch: Batch):
        x, v_first = embedding(batch.tokens, self.embed, self.dtype), None
        for i, layer in enumerate(self.layers):
            x, v_first = layer.forward(x, batch, i, v_first)
        return self.final_logits(x, batch)

    def head(self, x):
        return linear(layer_norm(x, self.norm, self.norm_b, self.args.norm_eps), self.lm_head)
