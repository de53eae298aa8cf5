"""Chunk- and batch-invariant float32 attention for one sequence (csrc/attention.cpp).

``attend(q, k, v, q_pos0, k_pos0, kind, window_or_chunk, scale, softcap, sinks=None)``: q
[Hq, T, D] at absolute positions ``q_pos0 ..``, k/v [Hk, S, D] at ``k_pos0 ..`` (grouped-query:
Hq % Hk == 0, any row / head strides, last dim contiguous). A query at ``p`` sees the keys at
``lo(p) <= pos <= p``: ``lo = 0`` (``kind="full"``), ``p - W + 1`` (``"sliding"``, W = window),
``(p // C) * C`` (``"chunked"``, C = chunk). ``sinks`` [Hq] (gpt-oss): a logit per query head that
joins the softmax denominator as a key without a value. Returns [T, Hq * D] float32.

The native kernel reduces every query's keys in blocks aligned to absolute positions, in an order
that depends only on those positions (docs/kernels.md), so a query's output row is bit-identical
whatever the number of queries in the call, the start of the key range or the prefill chunking.
Without the build (or for non-float32 / non-CPU tensors) ``reference`` computes the same math in
PyTorch (a plain masked softmax: equal to the kernel within float32 rounding, not invariant).

``TURNKV_ATTENTION=reference`` turns the native kernel off (tests, A/B); ``TURNKV_KERNEL_ISA``
caps its ISA path as for the matmul (avx512vnni runs the avx512 attention path).
"""

from __future__ import annotations

import os

import torch

from . import native_available

__all__ = ["attend", "reference", "native_attention_available", "native_sinks_available", "attention_isas", "KINDS"]

KINDS = {"full": 0, "sliding": 1, "chunked": 2}
KERNEL_BLOCK = 64     # the kernel's key block (attention.cpp BLK): write_attend's block tables are in these units
ISAS = ("scalar", "avx2", "avx512")

_op = None
_op_many = None   # several sequences in one call (a build from before it has none)
_best = -1
_default = -1
_sinks = False     # the build takes ``sinks`` (a build from before them does not)
_half_kv = False   # the build reads float16 / bfloat16 K/V
_int8_kv = False   # the build reads int8 K/V with a float16 scale per row (--kv-cache-mode int8)
_int4_kv = False   # the build reads packed int4 K/V with float16 group scales (--kv-cache-mode int4)
_write = None      # the extension's write_attend: a batch's K/V cache writes and attention in one call
_write_dtypes: frozenset = frozenset()   # cache buffer dtypes write_attend takes on the default path


def _init() -> None:
    global _op, _op_many, _best, _default, _sinks, _half_kv, _int8_kv, _int4_kv, _write, _write_dtypes
    if not native_available() or os.environ.get("TURNKV_ATTENTION", "").strip().lower() == "reference":
        return
    try:
        _op = torch.ops.turnkv_attn.attend
        _best = int(torch.ops.turnkv_attn.best_isa())
    except (AttributeError, RuntimeError):   # a build from before attention.cpp
        _op = None
        return
    _default = _best
    _op_many = getattr(torch.ops.turnkv_attn, "attend_many", None)
    try:
        _op_many = _op_many.default if _op_many is not None else None
    except (AttributeError, RuntimeError):
        _op_many = None
    _sinks = any(a.name == "sinks" for a in _op.default._schema.arguments)
    _half_kv = hasattr(torch.ops.turnkv_attn, "kv_dtypes")
    _int8_kv = _half_kv and int(torch.ops.turnkv_attn.kv_dtypes()) >= 4
    _int4_kv = _half_kv and int(torch.ops.turnkv_attn.kv_dtypes()) >= 5
    want = os.environ.get("TURNKV_KERNEL_ISA", "").strip().lower()
    if want == "avx512vnni":
        want = "avx512"
    if want in ISAS:
        _default = min(_best, ISAS.index(want))
    from . import _ext
    _write = getattr(_ext, "write_attend", None)
    _write_dtypes = frozenset({torch.float32} | ({torch.float16, torch.bfloat16} if _default > 0 else set())
                              | ({torch.int8} if _default > 0 and _int8_kv else set()))


_init()


def native_attention_available() -> bool:
    return _op is not None


def native_sinks_available() -> bool:
    return _op is not None and _sinks


def attention_isas() -> list[str]:
    """Native attention paths this CPU can run, lowest first (empty without the build)."""
    return list(ISAS[: _best + 1]) if _op is not None else []


def attention_info() -> str:
    return f"native {ISAS[_default]}" if _op is not None else "reference"


# Bumped whenever a native kernel's arithmetic changes (a reduction order, a rounding): model state
# an older build computed is then not what this build computes cold. 2: attention folds per-block
# partials (each block's own max), 2026-12-02.
NUMERICS = 2


def numerics_tag() -> str:
    """What a model's numbers depend on besides its weights, dtype and KV modes: the kernels'
    arithmetic version and the attention path (the ISA paths round differently; the GGUF matmuls
    and the norm give the same bits on every path). Part of ``Engine.load``'s fingerprint, so a
    disk or Redis tier entry written by another build or another CPU kind is a miss, not a restore
    whose continuation differs from a cold run."""
    return f"n{NUMERICS}-{ISAS[_default] if _op is not None else 'reference'}"


def lo_positions(kind: str, span: int, qpos: torch.Tensor) -> torch.Tensor:
    """First visible absolute position for each query position (``kind``'s rule)."""
    if kind == "full":
        return torch.zeros_like(qpos)
    if kind == "sliding":
        return (qpos - span + 1).clamp(min=0)
    if kind == "chunked":
        return torch.div(qpos, span, rounding_mode="floor") * span
    raise ValueError(f"attention kind {kind!r} (full, sliding, chunked)")


def visibility_mask(q_pos0: int, T: int, k_pos0: int, S: int, kind: str, span: int, device=None) -> torch.Tensor:
    """Boolean [T, S] (True = attend) for queries at q_pos0.. and keys at k_pos0..."""
    qpos = torch.arange(q_pos0, q_pos0 + T, device=device)[:, None]
    kpos = torch.arange(k_pos0, k_pos0 + S, device=device)[None, :]
    return (kpos <= qpos) & (kpos >= lo_positions(kind, span, qpos))


def reference(q, k, v, q_pos0: int, k_pos0: int, kind: str = "full", window_or_chunk: int = 0,
              scale: float | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch (float32 accumulation): scores, softcap, positional mask, softmax
    (with the sink column when given, dropped after it), P.V."""
    Hq, T, D = q.shape
    Hk, S = k.shape[0], k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    rep = Hq // Hk
    kf = k.float().repeat_interleave(rep, 0) if rep > 1 else k.float()
    vf = v.float().repeat_interleave(rep, 0) if rep > 1 else v.float()
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visibility_mask(q_pos0, T, k_pos0, S, kind, window_or_chunk, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        column = sinks.float().view(Hq, 1, 1).expand(Hq, T, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, vf)
    return out.transpose(0, 1).reshape(T, Hq * D).to(q.dtype)


_HALF = (torch.float16, torch.bfloat16)
_WIDENED = (*_HALF, torch.int8)   # K/V types widened here for the scalar path


def native_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
              scaled: bool = False) -> bool:
    """Whether the native kernel takes these tensors (float32 q on CPU, K/V float32 or, on the
    avx2 / avx512 paths, both float16 or both bfloat16, widened exactly on load, or both int8 with
    their float16 row scales (``scaled``), or, on every path, both packed int4 (uint8, two channels
    a byte, ``cache.storage.Int4Store``'s layout) with their float16 group scales (``scaled``);
    head_dim <= 1024; sinks float32 on CPU and a build that has them)."""
    kv_ok = k.dtype == v.dtype and (k.dtype == torch.float32 or (k.dtype in _HALF and _half_kv and _default > 0)
                                    or (k.dtype == torch.int8 and scaled and _int8_kv and _default > 0)
                                    or (k.dtype == torch.uint8 and scaled and _int4_kv))
    return (_op is not None and q.dtype == torch.float32 and kv_ok
            and q.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu"
            and q.shape[-1] <= 1024
            and (sinks is None or (_sinks and sinks.dtype == torch.float32 and sinks.device.type == "cpu")))


def _widen(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 K or V for the scalar path: int8 times its float16 row scales (exact, the values
    the SIMD paths read on load and ``cache.storage.dequantize_int8`` gives), else a plain cast."""
    return t if t.dtype == torch.float32 else (torch.mul(t, scale.float()) if scale is not None else t.float())


def attend_native(q, k, v, q_pos0: int, k_pos0: int, kind: str, window_or_chunk: int, scale: float,
                  softcap: float | None = None, isa: str | None = None,
                  sinks: torch.Tensor | None = None, scales: tuple | None = None) -> torch.Tensor:
    """The kernel itself (``native_ok`` must hold); any head / row strides, a copy only when the
    last dim is not contiguous. int8 ``k`` / ``v`` come with ``scales`` (their float16 [Hk, S, 1]
    row scales): the kernel reads ``int8 * scale``, exactly the float32 values of a dequantized
    copy, so the result is the bits it would give on that copy."""
    i = _default if isa is None else ISAS.index(isa)
    if i == 0 and k.dtype in _WIDENED:    # the scalar path reads float32 K/V only (int4 the kernel widens itself)
        k, v = _widen(k, scales[0] if scales else None), _widen(v, scales[1] if scales else None)
        scales = None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    args = (q, k, v, int(q_pos0), int(k_pos0), KINDS[kind], int(window_or_chunk or 0), float(scale),
            float(softcap) if softcap else 0.0, i)
    if scales is not None:
        return _op(*args, None if sinks is None else sinks.contiguous(), scales[0], scales[1])
    if sinks is None:
        return _op(*args)
    return _op(*args, sinks.contiguous())


def native_many_available() -> bool:
    return _op_many is not None


def attend_many_native(qs, ks, vs, q_pos0s, k_pos0s, kinds, spans, scale: float, softcap: float | None = None,
                       isa: str | None = None, sinks: torch.Tensor | None = None,
                       scales: list | None = None) -> torch.Tensor:
    """Several sequences' attention in one native call (``native_ok`` must hold for each): span j's
    queries ``qs[j]`` [Hq, T_j, D] over ``ks[j]``/``vs[j]`` (int8 ones with ``scales[j]``, every span
    int8 or none); returns their rows stacked in order, [sum T_j, Hq * D], each bit-identical to
    ``attend_native`` on that span alone."""
    i = _default if isa is None else ISAS.index(isa)
    fix = (lambda t: t if t.stride(-1) == 1 else t.contiguous())
    if i == 0 and ks[0].dtype in _WIDENED:     # the scalar path reads float32 K/V only (int4: widened in the kernel)
        pairs = scales or [(None, None)] * len(ks)
        ks = [_widen(k, s[0]) for k, s in zip(ks, pairs)]
        vs = [_widen(v, s[1]) for v, s in zip(vs, pairs)]
        scales = None
    return _op_many([fix(q) for q in qs], [fix(k) for k in ks], [fix(v) for v in vs],
                    [int(p) for p in q_pos0s], [int(p) for p in k_pos0s], [KINDS[k] for k in kinds],
                    [int(w or 0) for w in spans], float(scale), float(softcap) if softcap else 0.0, i,
                    None if sinks is None else sinks.contiguous(),
                    [s[0] for s in scales] if scales else None, [s[1] for s in scales] if scales else None)


def write_attend_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """Whether ``write_attend`` takes these rows (and ``write_buffers_ok`` the caches' buffers)."""
    return (_write is not None and q.dtype == torch.float32 and k.dtype == torch.float32
            and v.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] <= 1024
            and (sinks is None or (sinks.dtype == torch.float32 and sinks.device.type == "cpu")))


def write_buffers_ok(buffer_dtypes) -> bool:
    """Whether ``write_attend`` writes and reads cache K/V buffers of every dtype in ``buffer_dtypes``."""
    return _write is not None and all(d in _write_dtypes for d in buffer_dtypes)


def write_attend(q, k, v, kbufs, vbufs, lens, tables, q_pos0s, k_pos0s, kinds, spans, scale: float,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, isa: str | None = None,
                 kscales: list | None = None, vscales: list | None = None):
    """One layer for a batch of spans in one native call: span j (rows ``lens`` in order) stores its
    K/V rows of ``k`` / ``v`` [Hk, R, D] into its cache's blocks, then its queries of ``q``
    [Hq, R, D] at ``q_pos0s[j] ..`` attend over the positions ``k_pos0s[j] ..`` up to its last new
    one. K/V live in block pools ``kbufs[j]`` / ``vbufs[j]`` [Hk, slots, D] (float16 / bfloat16
    rounded as ``copy_`` rounds; int8 ones come with float16 scale buffers ``kscales[j]`` /
    ``vscales[j]`` [Hk, slots, 1] and are quantized as ``cache.storage.quantize_int8`` does): position
    ``p`` sits at slot ``tables[j][p // KERNEL_BLOCK] * KERNEL_BLOCK + p % KERNEL_BLOCK`` (int32
    block tables indexed by absolute block). Returns [R, Hq * D]; each row bit-identical to
    ``attend_native`` over the same keys (``write_attend_ok`` and ``write_buffers_ok`` must hold)."""
    plan = (kbufs, vbufs, lens, tables, q_pos0s, k_pos0s, [KINDS[x] for x in kinds],
            [int(w or 0) for w in spans], kscales, vscales)
    return write_attend_plan(q, k, v, plan, scale, softcap, sinks, isa)


def write_attend_plan(q, k, v, plan: tuple, scale: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """``write_attend`` with the cache side already in native form (``cache.write.write_plan``:
    kinds as ``KINDS`` codes, windows / chunks as ints, then the int8 scale buffers or None)."""
    i = _default if isa is None else ISAS.index(isa)
    return _write(q, k, v, *plan[:8], float(scale), float(softcap) if softcap else 0.0, i,
                  None if sinks is None else sinks.contiguous(), plan[8], plan[9])


def attention_isa() -> int:
    """The native attention path ``write_attend`` runs by default (an index into ``ISAS``)."""
    return _default


def attend(q, k, v, q_pos0: int, k_pos0: int, kind: str = "full", window_or_chunk: int = 0,
           scale: float | None = None, softcap: float | None = None, isa: str | None = None,
           native: bool | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq * D]; ``native`` None = the kernel when it takes the tensors, else the reference;
    ``isa`` picks a native path (tests)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    use = native_ok(q, k, v, sinks) if native is None else native
    if use:
        if _op is None:
            raise RuntimeError("native attention kernel unavailable (python -m turnkv.kernels.build)")
        if sinks is not None and not _sinks:
            raise RuntimeError("this build of the attention kernel has no sinks (python -m turnkv.kernels.build)")
        return attend_native(q, k, v, q_pos0, k_pos0, kind, window_or_chunk, scale, softcap, isa, sinks)
    return reference(q, k, v, q_pos0, k_pos0, kind, window_or_chunk, scale, softcap, sinks)
