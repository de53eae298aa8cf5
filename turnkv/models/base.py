"""What every model family shares: the Model interface and small pure helpers (RoPE, norms, attention).

A family file has the same shape every time: ``ModelArgs`` (built from an HF-style config dict),
attention, MLP, block, model, ``cache_specs()``. Families import these helpers; nothing inherits
behaviour beyond the ``Model`` interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels as _kernels
from ..cache.kv import KVView
from ..cache.specs import CacheSpec
from ..cache.write import write_plan
from ..kernels.attention import attend_many_native, attend_native, native_many_available, write_attend_plan
from ..kernels.attention import write_attend_ok
from ..kernels.attention import native_ok as native_attention_ok
from ..kernels.norm import native_rms_norm
from ..kernels.row_linear import native_op as native_row_linear
from ..kernels.row_linear import reference as row_linear_reference
from ..kernels.row_linear import each_row_op, sigmoid_op, sigmoid_reference
from ..loading.errors import ModelLoadError
from .batch import Batch, Span, select_rows
from .packed import PackedWeight

_native_norm = native_rms_norm()
_native_row_linear = native_row_linear()
_native_sigmoid = sigmoid_op()
_native_each_row = each_row_op()


class UnsupportedConfig(ModelLoadError, ValueError):
    """A config sets a field that changes what the model computes to a value the family does not
    implement: running it anyway would silently compute another model than transformers does."""


def refuse_unsupported(config: dict[str, Any], computes: dict[str, tuple]) -> None:
    """Raise UnsupportedConfig for the first ``computes`` field that ``config`` sets (not None) to
    a value outside the values the family computes."""
    for key, allowed in computes.items():
        value = config.get(key)
        if value is not None and value not in allowed:
            family = config.get("model_type", "this family")
            raise UnsupportedConfig(f"{family}: config field {key}={value!r} is not supported "
                                    f"(turnkv computes {key} in {list(allowed)})")


@dataclass
class BaseArgs:
    # Config fields that change the computation and that the family does not implement, each with
    # the values it does compute; from_dict refuses any other value. Keys that do not change the
    # logits (token ids, dtype, initializer_range, use_cache, ...) are simply ignored.
    computes: ClassVar[dict[str, tuple]] = {}

    @classmethod
    def from_dict(cls, config: dict[str, Any]):
        """Build from an HF config dict, ignoring keys the family does not use, after refusing
        the ``computes`` fields it sets to values the family does not implement."""
        refuse_unsupported(config, cls.computes)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


class Model(nn.Module, ABC):
    family: ClassVar[str]
    Args: ClassVar[type[BaseArgs]]     # the family's config fields (``from_checkpoint``)
    # Attribute names of the weights a non-native weight format may pack (models/weights.py).
    # ``packable_weights``: projections, only ever used through ``linear`` (empty = the family
    # supports native weights only); ``head_weights``: the lm_head (``linear``, one row in prefill);
    # ``embedding_weights``: tables only used through ``embedding``. A tied lm_head is the same
    # Parameter as the embedding under both names. ``gguf_only_weights``: projections used through
    # ``linear`` that keep their GGUF blocks when the file stores them quantized, but that the
    # packing formats leave in float (RWKV-7's low-rank projections, which llama.cpp keeps float).
    packable_weights: ClassVar[tuple[str, ...]] = ()
    gguf_only_weights: ClassVar[tuple[str, ...]] = ()
    head_weights: ClassVar[tuple[str, ...]] = ()
    embedding_weights: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def cache_specs(self) -> list[CacheSpec]: ...

    @abstractmethod
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Consume every span's tokens at its caches' offset (models/batch.py); return the logits
        of the rows the spans asked for, in span order ([R, V]), or None when none did."""

    def step(self, tokens: torch.Tensor, caches: list, logits: str = "last") -> torch.Tensor | None:
        """One sequence: ``logits`` "last" -> [V] for the last token, "all" -> [T, V], "none" -> None."""
        out = self.forward(Batch.build([(tokens, caches, logits)], tokens.device))
        return out[0] if logits == "last" else out

    @classmethod
    def from_checkpoint(cls, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> "Model":
        """The family's ``Args`` read from ``config``, then ``cls(args, config, tensors, dtype)``."""
        return cls(cls.Args.from_dict(config), config, tensors, dtype)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def enable_fused(self) -> int:
        """Let every block that can run as fused native calls do so (models/fused.py; the gguf
        weights at float32 call this after loading). Returns how many blocks will."""
        return sum(bool(m.fuse()) for m in self.modules() if m is not self and callable(getattr(m, "fuse", None)))

    # --- the decoder skeleton most families share ---------------------------------------------
    def run_decoder(self, x: torch.Tensor, batch: Batch, *extra) -> torch.Tensor | None:
        """Every block over the residual ``x`` (``block.forward(x, batch, i, *extra)``), then the
        final RMS norm and the lm_head on the rows that want logits."""
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, *extra)
        return self.final_logits(x, batch)

    def final_logits(self, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """``head`` on the rows of ``x`` that want logits (None: none); the rows themselves when
        the batch defers the head (``Batch.head`` False: a verified draft's rows, docs/speculative.md).
        Every row's ``x`` goes to ``Batch.hidden`` where the batch keeps them (the MTP drafter)."""
        if batch.hidden is not None:
            batch.hidden.append(x)
        x = select_rows(x, batch)
        if x is None or not batch.head:
            return x
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of final hidden states ``x`` [R, hidden]: the final norm and the lm_head
        (a family with another norm or a logit cap overrides). Row-wise: a row's logits do not
        depend on the rows beside it under the chunk-invariant kernels."""
        return linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)


# --- RoPE -----------------------------------------------------------------------------------------

class Rope:
    """Rotary embedding tables, computed as transformers computes them (float32, then cast) and
    grown geometrically as positions advance."""

    def __init__(self, head_dim: int, base: float, dtype: torch.dtype, device="cpu",
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0):
        if inv_freq is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq = inv_freq.to(device)
        self.scaling = attention_scaling
        self.dtype, self.device = dtype, device
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype)
        self._grow(256)

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        self.sin = (emb.sin() * self.scaling).to(self.dtype)

    def table(self, offset: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if offset + T > self.cos.shape[0]:
            n = self.cos.shape[0]
            while n < offset + T:
                n *= 2
            self._grow(n)
        return self.cos[offset:offset + T], self.sin[offset:offset + T]

    def rows(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, D] for every row of a batch, each at its span's positions (rotation is
        row-wise, so a family rotates all rows at once and keeps only attention per span)."""
        if len(batch.spans) == 1:
            s = batch.spans[0]
            return self.table(s.position, s.length)
        parts = [self.table(s.position, s.length) for s in batch.spans]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D] (any leading dims, any strides); cos/sin: [T, D] (or broadcastable).
    ``x * cos + rotate_half(x) * sin`` with the same roundings (bit-identical to transformers),
    without materializing ``rotate_half(x)``: the half products are accumulated in place."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


# --- attention --------------------------------------------------------------------------------------

def is_plain_causal(mask: torch.Tensor) -> bool:
    """True when ``mask`` [T, S] is exactly the top-left causal mask (a prefill from an empty cache,
    or one whose window does not bite yet): attention then runs ``is_causal=True``, which lets the
    flash kernel skip the blocks above the diagonal instead of computing and masking them."""
    T, S = mask.shape
    if T != S or T < 2 or not bool(mask[-1].all()):
        return False
    return int(mask.sum()) == T * (T + 1) // 2 and not bool(mask.triu(1).any())


def attention_spans(batch: Batch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every span's attention for one layer: each span writes its rows' K/V (``k``, ``v``:
    [Hk, R, D], the batch's rows) into its own cache ``span.caches[layer]`` and attends its
    queries (``q`` [Hq, R, D]) over what that cache returns. Returns [R, Hq * D] in row order.

    With the native kernel, all spans run in one native call (one parallel region per layer
    instead of one per sequence: decode of many sequences is many tiny attentions); each row is
    bit-identical to ``attention`` on its span alone. When every span's cache keeps its K/V as
    plain float buffers, or every one as int8 with row scales, that call also writes the new rows
    into them (``write_attend``: no per-sequence copies, slices and views in Python)."""
    spans: list[Span] = batch.spans
    if write_attend_ok(q, k, v, sinks=sinks):
        plan = write_plan([s.caches[layer] for s in spans], [s.length for s in spans])
        if plan is not None:
            return write_attend_plan(q, k, v, plan, scale, softcap, sinks)
    caches = [s.caches[layer] for s in spans]
    views = [c.update_and_fetch(k[:, s.rows], v[:, s.rows]) for c, s in zip(caches, spans)]
    qs = [q[:, s.rows] for s in spans]
    if len(spans) > 1 and native_many_available():
        kvs = [native_kv(qq, w, sinks) for qq, w in zip(qs, views)]
        int8 = {kv[2] is not None for kv in kvs if kv is not None}     # which spans read int8 K/V
        if all(kv is not None for kv in kvs) and len(int8) == 1:         # one call: all int8 or none
            return attend_many_native(qs, [kv[0] for kv in kvs], [kv[1] for kv in kvs],
                                      [w.query_pos0 for w in views], [w.key_pos0 for w in views],
                                      [w.kind for w in views], [w.span for w in views], scale, softcap, sinks=sinks,
                                      scales=[kv[2] for kv in kvs] if int8 == {True} else None)
    outs = [attention(qq, w, scale, softcap, sinks) for qq, w in zip(qs, views)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def native_kv(q: torch.Tensor, view: KVView, sinks: torch.Tensor | None = None):
    """(keys, values, scales) the native kernel takes for this view: float16 / bfloat16 / int8
    storage as stored when the kernel reads it (int8 with its row scales, else scales None),
    else the float32 keys and values; None when it takes neither."""
    if view.stored is not None and native_attention_ok(q, *view.stored, sinks, view.scales is not None):
        return view.stored[0], view.stored[1], view.scales
    if native_attention_ok(q, view.keys, view.values, sinks):
        return view.keys, view.values, None
    return None


def attention(q: torch.Tensor, view: KVView, scale: float, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, T, D] (the queries at ``view.query_pos0 ..``), ``view``: the layer cache's answer to
    ``update_and_fetch`` (keys/values [Hk, S, D], grouped-query allowed, their positions and the
    layer's visibility rule). Returns [T, Hq * D].

    ``sinks`` [Hq] (gpt-oss): one learned logit per query head that joins every query's softmax
    denominator (a key with no value): ``p_s = exp(s) / (exp(sink) + sum_s' exp(s'))``.

    float32 on CPU runs turnkv's native kernel (kernels/attention.py), sinks included: it reduces
    keys in blocks aligned to absolute positions, so a query's output is bit-identical however the
    prompt was chunked, cached or batched. Otherwise (other dtypes or devices, no build, or a build
    from before sinks): SDPA with the mask, or the explicit masked softmax (softcap, sinks)."""
    kv = native_kv(q, view, sinks)
    if kv is not None:
        return attend_native(q, kv[0], kv[1], view.query_pos0, view.key_pos0, view.kind, view.span, scale, softcap,
                             sinks=sinks, scales=kv[2])
    k, v = view.keys, view.values
    mask = view.mask
    Hq, T, D = q.shape
    if softcap is None and sinks is None:
        causal = mask is not None and is_plain_causal(mask)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=None if causal else mask,
                                             is_causal=causal, scale=scale, enable_gqa=k.shape[0] != Hq)[0]
    else:
        rep = Hq // k.shape[0]
        k = k.repeat_interleave(rep, 0) if rep > 1 else k
        v = v.repeat_interleave(rep, 0) if rep > 1 else v
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        wide = torch.promote_types(scores.dtype, torch.float32)   # bf16 / f16 scores: a float32 softmax
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=wide)
        else:   # the sink is one more column of the softmax, dropped after it
            column = sinks.to(scores.dtype).view(Hq, 1, 1).expand(Hq, T, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=wide)[..., :-1]
        out = torch.matmul(probs.to(q.dtype), v)
    return out.transpose(0, 1).reshape(T, Hq * D)


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """Every projection goes through here, so weight formats (bf16, weight-only int8 / int4; see
    models/weights.py) change in one place."""
    if isinstance(w, PackedWeight):
        out = w.matmul(x)
        return out if b is None else out + b
    return F.linear(x, w, b)


def rowwise_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` in x's dtype, every output in one fixed order (kernels/row_linear.py). A
    float GEMM's blocking rounds a row differently with other rows beside it (the GGUF kernels do
    not), so a float matrix whose output picks something discrete (every MoE router's top-k) or
    feeds a recurrence goes through here: its rows are the same bits whatever the chunk, the batch
    or the restored prefix. Register tiles, no cache blocking: for small matrices (routers,
    low-rank projections), which families keep in float32 so that ``w.float()`` copies nothing."""
    rows = x.reshape(-1, x.shape[-1]).float()
    wf = w.float()
    if _native_row_linear is not None and rows.is_cpu and wf.is_cpu:
        out = _native_row_linear(rows, wf, max(0, _kernels._isa))
    else:
        out = row_linear_reference(rows.contiguous(), wf.contiguous())
    out = out.to(x.dtype).view(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b


def sigmoid_each(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` of every element on its own, in x's dtype. ATen's loop takes most
    elements in vector steps (whose exp rounds otherwise) and the tail one at a time, so there a
    row's gate or router scores would change bits with the number of rows beside it or the
    threads' split; here each element is the bits it has alone (kernels/row_linear.py). bf16 and
    float16 go through float32 as ATen computes them."""
    if _native_sigmoid is not None and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _native_sigmoid(x.float()).to(x.dtype)
    return sigmoid_reference(x)


# an elementwise ATen call of at most this many values runs on one thread: ATen's GRAIN_SIZE is
# 32768, but its GeLU splits any call past 16384 values across the threads
ROW_GRAIN = 16384
# floats in whole unrolled vector steps of ATen's elementwise loop (2 x 16 on AVX-512, 2 x 8 on AVX2)
VECTOR_ROW = 64


def each_row(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (sigmoid, silu, softplus, gelu, exp, tanh, ...), every
    row (x's last dim) the bits it gets alone, whatever the rows beside it and the thread count.
    ATen splits a call of more than ``ROW_GRAIN`` values across threads wherever the split falls,
    and runs the values short of a whole unrolled vector step one at a time (its scalar tail),
    whose exp / tanh round otherwise than the vector ones for a few percent of inputs. So: blocks
    of whole rows of at most ``ROW_GRAIN`` values (``ROW_GRAIN``-column pieces of a longer row),
    each row its own inner loop (a width short of whole vector steps is read through a padded row
    stride, so contiguous rows never run on as one loop), each token's values contiguous. The
    native op runs the same blocks on the threads (float32; the same bits: one block's call is one
    thread's loop either way). The result is contiguous in x's shape; ``models/decoder.py``'s
    ``act_rows`` is the in-place twin."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] > 1 and width % VECTOR_ROW and rows.stride(0) == width:
        rows = F.pad(rows, (0, VECTOR_ROW - width % VECTOR_ROW))[:, :width]
    if rows.numel() <= ROW_GRAIN:
        return fn(rows).reshape(x.shape)
    op = _ROW_OPS.get(fn)
    if op is not None and _native_each_row is not None and rows.dtype == torch.float32 and rows.is_cpu:
        return _native_each_row(rows, op).reshape(x.shape)
    blocks = []
    for block in rows.split(max(1, ROW_GRAIN // width)):
        pieces = [fn(p) for p in block.split(ROW_GRAIN, dim=-1)]
        blocks.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1))
    return torch.cat(blocks).reshape(x.shape)


def embedding(tokens: torch.Tensor, w: torch.Tensor | PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Row lookup in an embedding table that may be packed (the ``bf16`` weight format)."""
    if isinstance(w, PackedWeight):
        return w.lookup(tokens, dtype)
    return F.embedding(tokens, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: turnkv's native op for float32 CPU tensors (one call, where torch
    runs six ops; a per-row fixed order, so rows are the same bits in any batch), else torch's."""
    if (_native_norm is not None and x.dtype == torch.float32 and x.is_cpu and not x.requires_grad
            and (weight is None or (weight.dtype == torch.float32 and weight.is_contiguous()
                                    and not weight.requires_grad))):
        return _native_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# the functions the native each_row runs, by its op number
_ROW_OPS = {torch.sigmoid: 0, F.silu: 1, F.softplus: 2, gelu_tanh: 3, torch.exp: 4, torch.tanh: 5}
