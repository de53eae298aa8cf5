"""A pre-norm decoder layer's two dense halves as one native call each (kernels/csrc/fused_layer.inc).

Under the ``gguf`` weights at float32 a decode step of a small model spends about as long in ~25
small ATen ops and Python wrappers per layer as in reading the layer's weights. ``FusedBlock``
runs the same operations in the same order with the same roundings in two calls:

- ``qkv(x, rope)``: input RMSNorm, the q/k/v projection, the optional per-head q/k RMSNorm (Gemma 3)
  and RoPE -> (q and k rotated [hq + hk, T, D], v [hk, T, D]);
- ``out_mlp(x, a)``: the o projection of the attention output ``a``, the optional post-attention
  norm, the residual add, the MLP (pre-norm, gate/up, silu or gelu-tanh, down, optional post norm)
  and its residual add, in place on the residual ``x``.

The attention between them runs per sequence over its own cache (models/base.py). ``layer(x,
rope, batch, i, scale)`` runs the whole layer as one native call (``fused_layer``: the two calls
with ``write_attend`` between them, in C++) when the caches take ``write_attend``, else as the
three calls from Python. The results are bit-identical to the unfused path
(tests/test_fused_layer.py), which the families keep for every other case (native weights, other
dtypes, biases, no build). ``TURNKV_FUSED=0`` turns it off (A/B); ``TURNKV_FUSED_LAYER=0`` keeps
the three calls.
"""

from __future__ import annotations

import operator
import os

import torch

from .. import kernels
from ..kernels import reference
from ..kernels.attention import KINDS, attention_isa
from ..kernels.norm import native_rms_norm
from .base import attention_spans, plan_of, write_plan, write_plans
from .weights import GGUFPacked

ACTS = {"silu": 0, "gelu_tanh": 1}


def fused_available() -> bool:
    """The build has the fused calls, the native RMSNorm (the unfused path's, whose bits they
    share) is on, and TURNKV_FUSED is not 0."""
    ext = kernels._ext
    return (ext is not None and hasattr(ext, "fused_qkv") and native_rms_norm() is not None
            and os.environ.get("TURNKV_FUSED", "1").strip() != "0")


def _qlinear(w):
    if not isinstance(w, GGUFPacked) or w.float_out:
        return None
    parts = w.parts
    # F16 / BF16 parts run their own float matmul, not the int8 one the fused calls are made of
    if not all(p.raw.is_cpu and p.tiled and p.qtype not in reference.FLOAT_W for p in parts):
        return None
    return kernels._ext.QLinear([p.raw for p in parts], [int(p.qtype) for p in parts], [int(p.shape[0]) for p in parts],
                                int(w.in_features))


def _vec(t):
    if t is None:
        return None
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_cpu):
        raise TypeError
    return t.detach().reshape(-1).contiguous()


class FusedSlot:
    """A block class's ``fused`` attribute (``fused = FusedSlot()``: its FusedBlock, or None): every
    assignment, on any block, moves ``FusedSlot.generation`` on, so ``stack_for`` sees whether any
    block's fused calls changed since it built a stack without touching the blocks (checking 30
    blocks by identity touched 30 cold objects, ~20 us of a one-sequence step)."""

    generation = 0

    def __set_name__(self, owner, name):
        self.key = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.key)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.key] = value
        FusedSlot.generation += 1


class FusedBlock:
    one_call = os.environ.get("TURNKV_FUSED_LAYER", "1").strip() != "0"   # ``layer`` as one call (A/B, tests)

    def __init__(self, *, hq: int, hk: int, head_dim: int, eps: float, attn_norm, wqkv, qk_norm, wo, post_attn,
                 mlp_norm, wgu, act: str, wdown, post_ff):
        self.hq, self.hk, self.d, self.eps = hq, hk, head_dim, float(eps)
        self.attn_norm, self.qk_norm = _vec(attn_norm), _vec(qk_norm)
        self.post_attn, self.mlp_norm, self.post_ff = _vec(post_attn), _vec(mlp_norm), _vec(post_ff)
        self.wqkv, self.wo, self.wgu, self.wdown = (_qlinear(w) for w in (wqkv, wo, wgu, wdown))
        self.act = ACTS[act]
        self.isa = kernels._isa_index(None)
        self.native = None      # the whole layer as one call (``layer``), where the build has it
        if (hasattr(kernels._ext, "fused_layer") and head_dim <= 1024       # write_attend's head_dim limit
                and None not in (self.wqkv, self.wo, self.wgu, self.wdown)):     # else ``build`` gives None
            self.native = kernels._ext.FusedLayer(self.attn_norm, self.eps, self.wqkv, hq, hk, head_dim, self.qk_norm,
                                                  self.wo, self.post_attn, self.mlp_norm, self.wgu, self.act,
                                                  self.wdown, self.post_ff, self.isa, attention_isa())

    @classmethod
    def build(cls, **kw) -> "FusedBlock | None":
        """The fused calls for one block, or None when its weights are not all GGUF blocks on the
        CPU, a norm weight is not float32, or the build lacks them."""
        if not fused_available():
            return None
        try:
            f = cls(**kw)
        except TypeError:
            return None
        if None in (f.wqkv, f.wo, f.wgu, f.wdown):
            return None
        return f

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and x.dim() == 2

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """(q and k after norm and RoPE [hq + hk, T, D], v [hk, T, D]) for the rows ``x`` [T, H]."""
        cos, sin = rope
        qkv, qk = kernels._ext.fused_qkv(x, self.attn_norm, self.eps, self.wqkv, self.hq, self.hk, self.d,
                                         self.qk_norm, self.eps, cos.contiguous(), sin.contiguous(), self.isa)
        v = qkv.view(x.shape[0], self.hq + 2 * self.hk, self.d).transpose(0, 1)[self.hq + self.hk:]
        return qk, v

    def layer(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch, i: int, scale: float,
              softcap: float | None = None) -> torch.Tensor:
        """The whole layer on the rows ``x`` (in place) with every span's attention over its own
        cache at layer ``i`` (``models.base.attention_spans``): one native call when the caches
        take ``write_attend`` (``models.base.write_plan``), else ``qkv``, ``attention_spans`` and
        ``out_mlp``. The same bits either way."""
        if self.native is not None and self.one_call:
            plan = write_plan(batch, i)
            if plan is not None:
                cos, sin = rope
                kernels._ext.fused_layer(self.native, x, cos.contiguous(), sin.contiguous(), *plan[:8], float(scale),
                                         float(softcap) if softcap else 0.0, plan[8], plan[9])
                return x
        qk, v = self.qkv(x, rope)
        return self.out_mlp(x, attention_spans(batch, i, qk[:self.hq], qk[self.hq:], v, scale, softcap))

    def out_mlp(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The rest of the layer on the attention output ``a`` [T, hq * D], in place on ``x``."""
        kernels._ext.fused_out_mlp(x, a.contiguous(), self.wo, self.post_attn, self.mlp_norm, self.eps, self.wgu,
                                   self.act, self.wdown, self.post_ff, self.isa)
        return x


def fuse_llama_block(block) -> "FusedBlock | None":
    """The fused calls of a Llama-shaped block: ``attn`` (hq, hk, d, wqkv, wo and no biases),
    ``mlp`` (wgu, wdown, SiLU, no biases), ``ln_attn``, ``ln_mlp``, ``eps`` (llama, ministral)."""
    a, m = block.attn, block.mlp
    if any(getattr(o, b, None) is not None for o, b in ((a, "bqkv"), (a, "bo"), (m, "bgu"), (m, "bdown"))):
        return None
    return FusedBlock.build(hq=a.hq, hk=a.hk, head_dim=a.d, eps=block.eps, attn_norm=block.ln_attn, wqkv=a.wqkv,
                            qk_norm=None, wo=a.wo, post_attn=None, mlp_norm=block.ln_mlp, wgu=m.wgu, act="silu",
                            wdown=m.wdown, post_ff=None)


_table_of = operator.attrgetter("_table")


def _same_tables(caches, tables) -> bool:
    """Each cache still holds the block table tensor in ``tables`` (identity, looped in C)."""
    return all(map(operator.is_, map(_table_of, caches), tables))


_FULL, _SLIDING = KINDS["full"], KINDS["sliding"]


class _Kept:
    """A FusedStack's native plan of the last step and what it was built from: the spans'
    lengths, each layer's block tables (a cache's own tensor, made again whenever its blocks
    change: the same object means the same cache and the same blocks), what the caches'
    ``reserve`` returned, by rule (``rules``: one ``[kind, window, reserved]`` per rule, full
    attention or a sliding window of that size, ``reserved`` the (first, query) positions per span,
    the same for every layer of the rule: a plan is kept only then; ``rule_of``: each layer's rule),
    and the pools' stores with the parts they had (a pool that grows gets new parts). It holds no
    cache, so it keeps no sequence's blocks alive."""

    __slots__ = ("native", "lens", "tables", "rules", "rule_of", "int8", "stores")

    def __init__(self, native, lens: list[int], plans: list[tuple], rules: list[list], rule_of: list[int],
                 per_layer: list[tuple]):
        self.native, self.lens, self.rules, self.rule_of = native, lens, rules, rule_of
        self.tables = [p[3] for p in plans]
        self.int8 = [p[8] is not None for p in plans]
        stores = {id(c.store): c.store for caches in per_layer for c in caches}
        self.stores = [(st, st.parts) for st in stores.values()]

    def expected(self) -> list[list[tuple[int, int]]]:
        """Per rule, what each span's ``reserve`` returns this step if its cache only moved on:
        the query position on by the span's length; the first position the same (full attention)
        or ``max(first, query - window + 1)`` (sliding: ``StackPlan.advance`` does the same)."""
        out = []
        for kind, window, reserved in self.rules:
            if kind == _FULL:
                out.append([(f, q + T) for (f, q), T in zip(reserved, self.lens)])
            else:
                out.append([(max(f, q + T - window + 1), q + T) for (f, q), T in zip(reserved, self.lens)])
        return out

    def moved_on(self, per_layer: list[tuple], reserved: list[list[tuple[int, int]]], expect: list) -> bool:
        """After every cache reserved this step's rows: whether each one returned what its rule
        expects (``expect``: ``expected()``), still holds the same blocks, and no pool grew, so
        the plan differs from the last step's by what ``StackPlan.advance`` moves alone."""
        return (all(r == expect[g] for r, g in zip(reserved, self.rule_of))
                and all(map(_same_tables, per_layer, self.tables))
                and all(st.parts is parts for st, parts in self.stores))


class FusedStack:
    """Every layer of a decoder as one native call a step (``fused_layers``): the same
    ``fused_layer`` calls in the same order, looped in C++. What it saves is the Python between
    the layers (about 10 us a layer, several times that in situ: each layer's weights and K/V
    evict the interpreter's code and data from the caches) and, in the server, the GIL: the engine
    thread takes it once a step instead of once a layer. The layers' cache plans are reserved in
    one pass first (``write_plans``); when any layer's caches do not take ``write_attend``,
    ``run`` does nothing and the family runs its layers one by one.

    The plans live in a native ``StackPlan`` kept from step to step: when the step's spans are the
    last step's caches with the same lengths and every one of them only moved on inside blocks it
    owns (most decode steps; a sliding-window cache until a block leaves its window), the kept
    plan moves its query positions on (and a sliding layer's first key positions with them) and
    nothing else is built or converted (``_Kept``); any other step builds and keeps a new one."""

    enabled = os.environ.get("TURNKV_FUSED_STACK", "1").strip() != "0"   # A/B, tests

    def __init__(self, fused: list[FusedBlock], scales: list[float], softcaps: list[float | None],
                 rope_of: list[int]):
        self.first = fused[0]
        self.natives = [f.native for f in fused]
        self.scales = [float(x) for x in scales]
        self.softcaps = [float(x) if x else 0.0 for x in softcaps]
        self.rope_of = [int(r) for r in rope_of]
        self._kept: _Kept | None = None

    @classmethod
    def of(cls, layers, scales, softcaps, rope_of) -> "FusedStack | None":
        """The stack of ``layers`` (family blocks with ``fused``), or None when it is off, the build
        lacks it, or a block does not run as one native call."""
        if not (cls.enabled and FusedBlock.one_call and hasattr(kernels._ext, "StackPlan")):
            return None
        fused = [getattr(layer, "fused", None) for layer in layers]
        if not fused or any(f is None or f.native is None for f in fused):
            return None
        return cls(fused, scales, softcaps, rope_of)

    def run(self, x: torch.Tensor, batch, ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Every layer on the rows ``x`` in place, the RoPE tables ``ropes[rope_of[i]]`` for layer
        ``i``; False, with nothing done, when ``x`` or some layer's caches do not take it."""
        if not self.first.takes(x):
            return False
        plan = self._plan(batch)
        if plan is None:
            return False
        kernels._ext.fused_layers(self.natives, x, [c.contiguous() for c, _ in ropes],
                                  [s.contiguous() for _, s in ropes], self.rope_of, plan, self.scales, self.softcaps)
        return True

    def _plan(self, batch):
        """The step's native plan, every cache's rows reserved; None, with nothing reserved, when
        some layer's caches do not take ``write_attend``."""
        n = len(self.natives)
        spans = batch.spans
        lens = [s.length for s in spans]
        kept = self._kept
        if kept is not None and kept.lens == lens:
            per_layer = list(zip(*[s.caches[:n] for s in spans]))
            if len(per_layer) == n and all(map(_same_tables, per_layer, kept.tables)):
                # the caches the kept plan was made for (their layouts took write_attend then)
                expect = kept.expected()
                reserved = [[c.reserve(T) for c, T in zip(caches, lens)] for caches in per_layer]
                if kept.moved_on(per_layer, reserved, expect):
                    kept.native.advance()
                    for rule, e in zip(kept.rules, expect):
                        rule[2] = e
                    return kept.native
                plans = [plan_of(lens, caches, int8, r) for caches, int8, r in zip(per_layer, kept.int8, reserved)]
                return self._keep(plans, lens, per_layer)
        plans = write_plans(batch, n)
        if plans is None:
            self._kept = None
            return None
        return self._keep(plans, lens, list(zip(*[s.caches[:n] for s in spans])))

    def _keep(self, plans: list[tuple], lens: list[int], per_layer: list[tuple]):
        native = kernels._ext.StackPlan(plans)
        # kept when every layer is full attention or sliding-window, one rule for all its spans,
        # and every layer of a rule reserved alike (the usual lockstep of a sequence's layers); a
        # chunked layer's plan (no fused family has one) is built every step
        rules: dict[tuple[int, int], list] = {}
        rule_of: list[int] = []
        keep = True
        for p in plans:
            kinds, spans = p[6], p[7]
            rule = (kinds[0], spans[0] if kinds[0] == _SLIDING else 0)
            reserved = list(zip(p[5], p[4]))
            if (rule[0] not in (_FULL, _SLIDING) or any(k != kinds[0] for k in kinds)
                    or (rule[0] == _SLIDING and any(w != spans[0] for w in spans))):
                keep = False
                break
            got = rules.setdefault(rule, [rule[0], rule[1], reserved])
            if got[2] != reserved:
                keep = False
                break
            rule_of.append(list(rules).index(rule))
        self._kept = _Kept(native, lens, plans, list(rules.values()), rule_of, per_layer) if keep else None
        return native


def stack_for(model, scales, softcaps, rope_of) -> "FusedStack | None":
    """``model``'s FusedStack, rebuilt when a block's fused calls changed (``enable_fused``, a
    test's switch: ``FusedSlot.generation``) or a switch of the fused path did. Asked once a step."""
    key = (FusedStack.enabled, FusedBlock.one_call, FusedSlot.generation, len(model.layers))
    kept = model.__dict__.get("_fused_stack")
    if kept is None or kept[0] != key:
        kept = (key, FusedStack.of(model.layers, scales(), softcaps(), rope_of()))
        model.__dict__["_fused_stack"] = kept
    return kept[1]
