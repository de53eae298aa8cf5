"""A pre-norm decoder layer's two dense halves as one native call each (kernels/csrc/fused_layer.inc).

Under the ``gguf`` weights at float32 a decode step of a small model spends about as long in ~25
small ATen ops and Python wrappers per layer as in reading the layer's weights. ``FusedBlock``
runs the same operations in the same order with the same roundings in two calls:

- ``qkv(x, rope)``: input RMSNorm, the q/k/v projection, the optional per-head q/k RMSNorm (Gemma 3)
  and RoPE -> (q and k rotated [hq + hk, T, D], v [hk, T, D]);
- ``out_mlp(x, a)``: the o projection of the attention output ``a``, the optional post-attention
  norm, the residual add, the MLP (pre-norm, gate/up, silu or gelu-tanh, down, optional post norm)
  and its residual add, in place on the residual ``x``. A MoE layer's MLP (``moe``: Qwen 3 MoE's
  softmax router, top-k, routed experts) runs there as models/qwen3_moe.py computes it, decode
  steps and prefill chunks alike.

The attention between them runs per sequence over its own cache (models/base.py). ``layer(x,
rope, batch, i, scale)`` runs the whole layer as one native call (``fused_layer``: the two calls
with ``write_attend`` between them, in C++) when the caches take ``write_attend``, else as the
three calls from Python. The results are bit-identical to the unfused path
(tests/test_fused_layer.py), which the families keep for every other case (native weights, other
dtypes, biases, no build). ``TURNKV_FUSED=0`` turns it off (A/B); ``TURNKV_FUSED_LAYER=0`` keeps
the three calls.
"""

from __future__ import annotations

import os

import torch

from .. import kernels
from ..cache.write import KeptWrites, write_plan
from ..kernels import reference
from ..kernels.attention import attention_isa
from ..kernels.norm import native_rms_norm
from .base import attention_spans
from .weights import GGUFPacked

ACTS = {"silu": 0, "gelu_tanh": 1}


def fused_available() -> bool:
    """The build has the fused calls, the native RMSNorm (the unfused path's, whose bits they
    share) is on, and TURNKV_FUSED is not 0."""
    ext = kernels._ext
    return (ext is not None and hasattr(ext, "fused_qkv") and native_rms_norm() is not None
            and os.environ.get("TURNKV_FUSED", "1").strip() != "0")


def _qlinear(w, head: bool = False):
    """The native QLinear of a GGUFPacked weight, or None. ``head``: the lm_head's (``float_out``:
    its logits float32 whatever the compute dtype, which the fused calls' float32 rows are)."""
    if not isinstance(w, GGUFPacked) or (w.float_out and not head):
        return None
    parts = w.parts
    # F16 / BF16 parts run their own float matmul, not the int8 one the fused calls are made of
    if not all(p.raw.is_cpu and p.tiled and p.qtype not in reference.FLOAT_W for p in parts):
        return None
    return kernels._ext.QLinear([p.raw for p in parts], [int(p.qtype) for p in parts], [int(p.shape[0]) for p in parts],
                                int(w.in_features))


def _moe_layer(router, experts, top_k: int, norm_topk: bool):
    """The native MoELayer of a router [E, H] and RoutedExperts whose native call is on."""
    if not hasattr(kernels._ext, "MoELayer") or (experts.native is None and not experts.fuse()):
        raise TypeError
    if not (isinstance(router, torch.Tensor) and router.dtype == torch.float32 and router.is_cpu):
        raise TypeError
    return kernels._ext.MoELayer(experts.native, router.detach().contiguous(), int(top_k), bool(norm_topk))


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
                 mlp_norm, wgu, act: str, wdown, post_ff, moe: tuple | None = None):
        self.hq, self.hk, self.d, self.eps = hq, hk, head_dim, float(eps)
        self.attn_norm, self.qk_norm = _vec(attn_norm), _vec(qk_norm)
        self.post_attn, self.mlp_norm, self.post_ff = _vec(post_attn), _vec(mlp_norm), _vec(post_ff)
        self.wqkv, self.wo, self.wgu, self.wdown = (_qlinear(w) for w in (wqkv, wo, wgu, wdown))
        self.act = ACTS[act]
        self.isa = kernels._isa_index(None)
        # moe: (router, RoutedExperts, top_k, norm_topk) in place of wgu / wdown
        self.moe = _moe_layer(*moe) if moe is not None else None
        self.complete = None not in (self.wqkv, self.wo) and (self.moe is not None or None not in (self.wgu, self.wdown))
        self.native = None      # the whole layer as one call (``layer``), where the build has it
        if hasattr(kernels._ext, "fused_layer") and head_dim <= 1024 and self.complete:   # write_attend's head_dim limit
            self.native = kernels._ext.FusedLayer(self.attn_norm, self.eps, self.wqkv, hq, hk, head_dim, self.qk_norm,
                                                  self.wo, self.post_attn, self.mlp_norm, self.wgu, self.act,
                                                  self.wdown, self.post_ff, self.isa, attention_isa(), self.moe)

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
        return f if f.complete else None

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
        take ``write_attend`` (``cache.write.write_plan``), else ``qkv``, ``attention_spans`` and
        ``out_mlp``. The same bits either way."""
        if self.native is not None and self.one_call:
            spans = batch.spans
            plan = write_plan([s.caches[i] for s in spans], [s.length for s in spans])
            if plan is not None:
                cos, sin = rope
                kernels._ext.fused_layer(self.native, x, cos.contiguous(), sin.contiguous(), *plan[:8], float(scale),
                                         float(softcap) if softcap else 0.0, plan[8], plan[9])
                return x
        qk, v = self.qkv(x, rope)
        return self.out_mlp(x, attention_spans(batch, i, qk[:self.hq], qk[self.hq:], v, scale, softcap))

    def out_mlp(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The rest of the layer on the attention output ``a`` [T, hq * D], in place on ``x``."""
        if self.moe is not None:
            kernels._ext.fused_out_moe(x, a.contiguous(), self.wo, self.post_attn, self.mlp_norm, self.eps, self.moe,
                                       self.isa)
            return x
        kernels._ext.fused_out_mlp(x, a.contiguous(), self.wo, self.post_attn, self.mlp_norm, self.eps, self.wgu,
                                   self.act, self.wdown, self.post_ff, self.isa)
        return x


class NormHead:
    """A decoder's final RMSNorm and its lm_head as one native call (``norm_head``,
    kernels/csrc/norm_head.inc), where ``Model.head`` ran the norm op and four Python wrappers
    around the matmul once per step, cold after the layers: the same row function and kernels, so
    the same bits (tests/test_fused_layer.py). Off where the fused calls are (``fused_available``)."""

    def __init__(self, norm, eps: float, w):
        self.norm, self.eps, self.w, self.isa = norm, float(eps), w, kernels._isa_index(None)

    @classmethod
    def build(cls, norm, eps: float, lm_head) -> "NormHead | None":
        """The call for this norm weight (float32, or None) and head, or None when the head is not
        GGUF blocks the int8 kernels run, or the build lacks it."""
        if not (fused_available() and hasattr(kernels._ext, "norm_head")):
            return None
        try:
            norm = _vec(norm)
        except TypeError:
            return None
        w = _qlinear(lm_head, head=True)
        return None if w is None else cls(norm, eps, w)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels._ext.norm_head(x, self.norm, self.eps, self.w, self.isa)


def fuse_llama_block(block) -> "FusedBlock | None":
    """The fused calls of a Llama-shaped block: ``attn`` (hq, hk, d, wqkv, wo and no biases),
    ``mlp`` (wgu, wdown, SiLU, no biases; or a Qwen 3 MoE layer: ``w_router``, ``experts``,
    ``top_k``, ``norm_topk``), ``ln_attn``, ``ln_mlp``, ``eps``, and the attention's ``qk_norm``
    rows where it has them (llama, Qwen 3, Qwen 3 MoE, ministral)."""
    a, m = block.attn, block.mlp
    if any(getattr(o, b, None) is not None for o, b in ((a, "bqkv"), (a, "bo"), (m, "bgu"), (m, "bdown"))):
        return None
    moe = (m.w_router, m.experts, m.top_k, m.norm_topk) if hasattr(m, "w_router") else None
    return FusedBlock.build(hq=a.hq, hk=a.hk, head_dim=a.d, eps=block.eps, attn_norm=block.ln_attn, wqkv=a.wqkv,
                            qk_norm=getattr(a, "qk_norm", None), wo=a.wo, post_attn=None, mlp_norm=block.ln_mlp,
                            wgu=getattr(m, "wgu", None), act="silu", wdown=getattr(m, "wdown", None), post_ff=None, moe=moe)


class FusedStack:
    """Every layer of a decoder as one native call a step (``fused_layers``): the same
    ``fused_layer`` calls in the same order, looped in C++. What it saves is the Python between
    the layers (about 10 us a layer, several times that in situ: each layer's weights and K/V
    evict the interpreter's code and data from the caches) and, in the server, the GIL: the engine
    thread takes it once a step instead of once a layer. The caches reserve every layer's rows
    in one pass first and keep the native ``StackPlan`` from step to step, advancing it where
    every cache only moved on (cache/write.py ``KeptWrites``); when any layer's caches do not
    take ``write_attend``, ``run`` does nothing and the family runs its layers one by one."""

    enabled = os.environ.get("TURNKV_FUSED_STACK", "1").strip() != "0"   # A/B, tests

    def __init__(self, fused: list[FusedBlock], scales: list[float], softcaps: list[float | None],
                 rope_of: list[int]):
        self.first = fused[0]
        self.natives = [f.native for f in fused]
        self.scales = [float(x) for x in scales]
        self.softcaps = [float(x) if x else 0.0 for x in softcaps]
        self.rope_of = [int(r) for r in rope_of]
        self._writes = KeptWrites(_stack_plan)

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
        ``i``; False, with nothing done, when ``x`` or some layer's caches do not take it. The last
        layer finishes only the rows whose logits the batch asks for (``Batch.logit_rows``: a
        prompt's last row, none in its earlier chunks; every row's K/V is written): the others keep
        the layer's input, which nothing reads (the caller's ``final_logits`` takes those rows)."""
        if not self.first.takes(x):
            return False
        spans = batch.spans
        lens = [s.length for s in spans]
        plan = self._writes.plan([s.caches for s in spans], lens, len(self.natives))
        if plan is None:
            return False
        keep = [s.logit_count() for s in spans]
        kernels._ext.fused_layers(self.natives, x, [c.contiguous() for c, _ in ropes],
                                  [s.contiguous() for _, s in ropes], self.rope_of, plan, self.scales, self.softcaps,
                                  None if keep == lens else keep)
        return True


def _stack_plan(plans: list[tuple]):
    """The native plan of every layer's write plans (looked up at each call: tests count them)."""
    return kernels._ext.StackPlan(plans)


def stack_for(model, scales, softcaps, rope_of) -> "FusedStack | None":
    """``model``'s FusedStack, rebuilt when a block's fused calls changed (``enable_fused``, a
    test's switch: ``FusedSlot.generation``) or a switch of the fused path did. Asked once a step."""
    key = (FusedStack.enabled, FusedBlock.one_call, FusedSlot.generation, len(model.layers))
    kept = model.__dict__.get("_fused_stack")
    if kept is None or kept[0] != key:
        kept = (key, FusedStack.of(model.layers, scales(), softcaps(), rope_of()))
        model.__dict__["_fused_stack"] = kept
    return kept[1]
