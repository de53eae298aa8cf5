"""GGUF quantized weights run as stored: int8 activations, integer dot products.

`GGUFWeight` holds a tensor's GGUF bytes and multiplies float activations with them through the
native extension (`csrc/gguf_matmul.cpp`, built by `python -m turnkv.kernels.build`) or, when
that is missing, through the pure-PyTorch reference (`reference.py`), which computes the very same
numbers (docs/kernels.md). With the build, weights are held in tiles of 8 rows (`tile_rows`: the
same bytes, each block's fields of the 8 rows side by side, so the kernels load them without
transposing); without it they keep GGUF's row layout. `GGUFWeight.rows()` gives GGUF's rows
either way.

`TURNKV_KERNEL_ISA=scalar|avx2|avx512|avx512vnni` forces a lower native path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import warnings
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import reference, tiles
from .tiles import TILE_ROWS, _row_gather, tile_rows, untile_rows

_Q = GGMLQuantizationType

__all__ = ["GGUFWeight", "GGUFStack", "describe_types", "kernel_info", "native_available", "settle_deferred", "ISAS",
           "SUPPORTED", "tile_pending", "tile_rows", "untile_rows"]

SUPPORTED = reference.SUPPORTED
_ROW_DEQUANT = {_Q.Q4_K, _Q.Q5_K, _Q.Q6_K}     # GGUFWeight.lookup's native row dequantization (csrc/row_dequant.inc)
ISAS = ("scalar", "avx2", "avx512", "avx512vnni")
BUILD_DIR = Path(__file__).resolve().parent / "_build"
EXT_NAME = "turnkv_gguf_kernels"

_ext = None
_ext_error: str | None = None
_isa: int = -1  # index into ISAS of the path used by default
_warned = False


def _load() -> None:
    global _ext, _ext_error, _isa
    paths = sorted(glob.glob(str(BUILD_DIR / f"{EXT_NAME}*.so")))
    if not paths:
        _ext_error = "build missing: run `python -m turnkv.kernels.build`"
    else:
        try:
            spec = importlib.util.spec_from_file_location(EXT_NAME, paths[0])
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _ext = mod
        except Exception as e:  # a stale or foreign binary: fall back, say why once
            _ext_error = f"build failed to load: {e}"
    if _ext is None:
        return  # warned once, at the first matmul that falls back
    best = int(_ext.best_isa())
    want = os.environ.get("TURNKV_KERNEL_ISA", "").strip().lower()
    _isa = best
    if want:
        if want not in ISAS:
            warnings.warn(f"TURNKV_KERNEL_ISA={want!r} unknown (one of {', '.join(ISAS)}); using {ISAS[best]}",
                          RuntimeWarning, stacklevel=3)
        elif ISAS.index(want) > best:
            warnings.warn(f"TURNKV_KERNEL_ISA={want} not supported by this CPU; using {ISAS[best]}",
                          RuntimeWarning, stacklevel=3)
        else:
            _isa = ISAS.index(want)


_load()
if _ext is not None and hasattr(_ext, "tile_gather"):
    tiles.native_gather = _ext.tile_gather


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"turnkv.kernels: native GGUF kernels unavailable ({_ext_error}); using the PyTorch reference",
                      RuntimeWarning, stacklevel=3)


def native_available() -> bool:
    return _ext is not None


def best_isa() -> str | None:
    """Best native path this CPU supports (None without the build)."""
    return ISAS[int(_ext.best_isa())] if _ext is not None else None


def available_isas() -> list[str]:
    """Native paths this CPU can run, lowest first (empty without the build)."""
    return list(ISAS[: int(_ext.best_isa()) + 1]) if _ext is not None else []


def kernel_info() -> str:
    """One line for a start-up message: which GGUF matmul path runs."""
    if _ext is None:
        return f"reference ({_ext_error})"
    paired = ", decode rows paired in 512-bit vectors" if _isa >= 2 and int(_ext.pair()) else ""
    return f"native {ISAS[_isa]}{paired}"


def describe_types(tensors, kept: dict | None = None) -> str:
    """Which kernel runs each type of a GGUF's tensors, for the start-up banner and `turnkv
    models`: ``tensors`` are (GGMLQuantizationType, shape) pairs, ``kept`` the loaded model's
    count of file tensors per type it kept in blocks (None: every 2-D tensor and 3-D expert stack
    of a type these kernels take). A type's other tensors (a quantization without a kernel, a
    tensor the loader had to transform) are named as float32 copies. 1-D tensors (norms) are left
    out."""
    total: dict = {}
    blocks: dict = {}
    for qtype, shape in tensors:
        if len(shape) >= 2:
            q = GGMLQuantizationType(qtype)
            total[q] = total.get(q, 0) + 1
            blocks[q] = blocks.get(q, 0) + (len(shape) in (2, 3))
    if kept is None:
        kept = {q: n for q, n in blocks.items() if q in SUPPORTED}
    fmt = lambda c: ", ".join(f"{q.name} x {n}" for q, n in sorted(c.items(), key=lambda e: e[0].value))  # noqa: E731
    native = {q: kept[q] for q in total if kept.get(q)}
    floats = {q: n - kept.get(q, 0) for q, n in total.items() if q != _Q.F32 and n > kept.get(q, 0)}
    out = []
    if native:
        out.append(f"{fmt(native)}: {kernel_info()}")
    if floats:
        out.append(f"{fmt(floats)}: float32 copies (no kernel for the type or the layout)")
    if _Q.F32 in total:
        out.append(f"{fmt({_Q.F32: total[_Q.F32]})}: float32 as stored")
    return "; ".join(out) if out else "no 2-D tensors"


def _own_bytes(raw, qtype: GGMLQuantizationType, rows: int, k: int) -> torch.Tensor:
    """``raw`` (numpy or torch uint8) as a torch uint8 tensor [rows, row_bytes] (a read-only
    numpy array copied, a writable one viewed), after checking that rows of ``k`` values are whole
    blocks of ``qtype``."""
    if qtype not in SUPPORTED:
        raise NotImplementedError(f"GGUFWeight: {qtype.name} not supported")
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"GGUFWeight: K={k} not a multiple of {qtype.name}'s block {block}")
    if isinstance(raw, np.ndarray):
        arr = np.ascontiguousarray(raw, dtype=np.uint8)
        if not arr.flags.writeable:  # e.g. a view of a file's mmap: own the bytes
            arr = arr.copy()
        raw = torch.from_numpy(arr)
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGUFWeight: raw must be uint8, got {raw.dtype}")
    return raw.reshape(rows, k // block * size)


def _isa_index(isa: str | None) -> int:
    if isa is None:
        return _isa
    i = ISAS.index(isa)
    if i > int(_ext.best_isa()):
        raise ValueError(f"ISA {isa} not supported by this CPU (best: {ISAS[int(_ext.best_isa())]})")
    return i


class GGUFWeight:
    """A [N, K] weight kept as its GGUF blocks: ``raw`` is uint8, with the native build its tiles
    of 8 rows (``tiled``; [ceil(N/8)*8, row_bytes]), else GGUF's rows [N, row_bytes]. ``base``:
    the ``GGUFStack`` whose bytes ``raw`` views (one expert of a stack), else None.

    A weight made with ``from_raw(..., defer=True)`` holds GGUF's rows (``_pending``: typically a
    view of the file's mapping, with the row order ``from_raw`` was given) until its tiles are
    first needed: ``raw`` tiles them then. ``cat`` of such weights makes a fused weight whose parts
    are pending in turn, each bound for its place in the fused weight's buffer, so a loaded
    weight's bytes are read from the file once and written once, and ``settle_deferred`` tiles
    every weight still pending at the end of a load in one native call (one parallel region)."""

    __slots__ = ("_raw", "_pending", "qtype", "shape", "tiled", "base", "__weakref__")

    def __init__(self, raw: torch.Tensor | None, qtype: GGMLQuantizationType, shape: tuple[int, int],
                 tiled: bool = False, base: "GGUFStack | None" = None, pending: "list[Pending] | None" = None):
        self._raw = raw          # with _pending: the buffer its tiles go to (None: made when tiled)
        self._pending = pending
        self.qtype = qtype
        self.shape = shape
        self.tiled = tiled
        self.base = base

    @property
    def raw(self) -> torch.Tensor:
        if self._pending is not None:
            tile_pending([self])
        return self._raw

    @classmethod
    def from_raw(cls, raw, qtype, shape, defer: bool = False, order: torch.Tensor | None = None) -> "GGUFWeight":
        """``defer``: tile later (see the class); ``raw`` must then stay unchanged until then.
        ``order`` (int64 [N]): the weight's row i is ``raw``'s row ``order[i]`` (a family's row
        permutation of a file's rows), moved while tiling instead of copied first."""
        qtype = GGMLQuantizationType(qtype)
        n, k = int(shape[0]), int(shape[1])
        raw = _own_bytes(raw, qtype, n if order is None else -1, k).contiguous()
        if order is not None:
            order = torch.as_tensor(order, dtype=torch.int64).reshape(-1).contiguous()
            if order.numel() != n:
                raise ValueError(f"GGUFWeight: order names {order.numel()} rows for a weight of {n}")
        if _ext is not None and raw.is_cpu:   # the layout the native kernels read
            if not defer:
                return cls(tile_rows(raw, qtype, order=order), qtype, (n, k), tiled=True)
            return _deferred(cls(None, qtype, (n, k), tiled=True, pending=[Pending(raw, order, 0)]))
        return cls(raw if order is None else raw.index_select(0, order), qtype, (n, k))

    def rows(self) -> torch.Tensor:
        """GGUF's own rows [N, row_bytes] (a copy when tiled)."""
        return untile_rows(self.raw, self.qtype, self.shape[0]) if self.tiled else self.raw

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    @property
    def row_bytes(self) -> int:
        pending = self._pending
        return (self._raw if pending is None else pending[0].rows).shape[1]

    def __repr__(self) -> str:
        return f"GGUFWeight({self.qtype.name}, shape={self.shape})"

    def matmul(self, x: torch.Tensor, isa: str | None = None, native: bool | None = None) -> torch.Tensor:
        """x [..., K] float32/bfloat16 -> [..., N] in x.dtype (float32 accumulation).

        `isa` picks a native path (tests, A/B); `native=False` forces the PyTorch reference.
        """
        n, k = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        # the native kernels are CPU code; tensors elsewhere (CUDA) take the torch reference
        use_native = (_ext is not None and x2.is_cpu and self.raw.is_cpu) if native is None else native
        if use_native:
            if _ext is None:
                raise RuntimeError(f"native GGUF kernels unavailable: {_ext_error}")
            if not self.tiled:
                raise RuntimeError("the native GGUF kernels read weights as tiles of 8 rows: build the weight "
                                   "with GGUFWeight.from_raw")
            if x2.dtype != torch.float32:
                x2 = x2.float()
            y = _ext.gguf_matmul(x2.contiguous(), self.raw, int(self.qtype), n, k, _isa_index(isa))
        else:
            if native is None and _ext is None:
                _warn_fallback()
            y = reference.matmul(x2, self.rows(), self.qtype, n, k)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.reshape(*lead, n)


    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, bit-exact with gguf.quants.dequantize."""
        return reference.dequantize(self.rows(), self.qtype, self.shape)

    def _rows_at(self, index: torch.Tensor) -> torch.Tensor:
        """GGUF rows ``index`` [n, row_bytes]; tiled: one gather of each row's bytes from its tile
        (``_row_gather``), so a decode step's embedding row costs one small index op."""
        if not self.tiled:
            return self.raw.index_select(0, index)
        rb = self.raw.shape[1]
        at = (index // TILE_ROWS * (TILE_ROWS * rb))[:, None] + _row_gather(self.qtype, rb)[index % TILE_ROWS]
        return self.raw.view(-1)[at]

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Embedding rows: ids [...] -> [..., K] dequantized (bit-exact), in dtype."""
        flat = ids.reshape(-1).long()
        if self.tiled and self.qtype in _ROW_DEQUANT and hasattr(_ext, "dequant_rows") and self.raw.is_cpu:
            # the native row dequantization: gguf-py's arithmetic in C++, the same bits (~0.27 ms
            # less a Qwen3-4B decode step's Q6_K row than numpy's, Zen 2)
            out = _ext.dequant_rows(self.raw, int(self.qtype), flat, self.shape[0], self.shape[1])
            return out.to(dtype).reshape(*ids.shape, self.shape[1])
        out = reference.dequantize(self._rows_at(flat), self.qtype, (flat.numel(), self.shape[1]))
        return out.to(dtype).reshape(*ids.shape, self.shape[1])

    def take_rows(self, index: torch.Tensor) -> "GGUFWeight":
        """Rows `index` (a permutation or selection) as a new weight; the blocks move unchanged."""
        index = torch.as_tensor(index).reshape(-1).long()
        return GGUFWeight.from_raw(self._rows_at(index).contiguous(), self.qtype, (index.numel(), self.shape[1]))

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Concatenate along N (fused qkv / gate-up). Parts must share qtype and K."""
        if not parts:
            raise ValueError("GGUFWeight.cat: no parts")
        q, k = parts[0].qtype, parts[0].shape[1]
        for p in parts:
            if p.qtype != q or p.shape[1] != k:
                raise ValueError(f"GGUFWeight.cat: mixed parts ({q.name}, K={k}) vs ({p.qtype.name}, K={p.shape[1]})")
        n = sum(p.shape[0] for p in parts)
        if all(p.tiled for p in parts) and all(p.shape[0] % TILE_ROWS == 0 for p in parts[:-1]):
            # whole tiles: the parts' tiles one after the other are the tiles of their rows (a
            # deferred part's rows stay pending, bound for their place)
            out = tiles.weight_buffer(_tiled(n), parts[0].row_bytes)
            pending, at = [], 0
            for p in parts:
                rows = p._pending
                if rows is not None:
                    pending += [r._replace(at=r.at + at) for r in rows]
                else:
                    out[at:at + _tiled(p.shape[0])].copy_(p._raw)
                at += _tiled(p.shape[0])
            return _deferred(GGUFWeight(out, q, (n, k), tiled=True, pending=pending or None))
        raw = torch.cat([p.rows() for p in parts], 0)
        return GGUFWeight.from_raw(raw, q, (n, k))


class Pending(NamedTuple):
    """GGUF rows of a deferred weight, to be tiled into its buffer from tile row ``at`` on
    (``order``: ``tile_rows``')."""
    rows: torch.Tensor
    order: torch.Tensor | None
    at: int


_DEFERRED: "weakref.WeakSet[GGUFWeight]" = weakref.WeakSet()


def _tiled(n: int) -> int:
    return -(-n // TILE_ROWS) * TILE_ROWS


def _deferred(weight: GGUFWeight) -> GGUFWeight:
    if weight._pending is not None:
        _DEFERRED.add(weight)
    return weight


def tile_pending(weights: list[GGUFWeight]) -> None:
    """The pending rows of ``weights`` into their tiles (a weight's own buffer made now where it
    has none), all in one ``tiles.tile_many`` call: one parallel region. A load calls it with
    every weight the built model keeps (models/gguf_weights.py) before the fused calls take their
    tiles, and ``settle_deferred`` with what is left."""
    jobs, done = [], []
    for w in {id(w): w for w in weights}.values():      # a weight named twice (a tied head) once
        pending = w._pending
        if pending is None:
            continue
        if w._raw is None:
            w._raw = tiles.weight_buffer(_tiled(w.shape[0]), pending[0].rows.shape[1])
        for p in pending:
            n = p.rows.shape[0] if p.order is None else p.order.numel()
            jobs.append((p.rows, w.qtype, w._raw[p.at:p.at + _tiled(n)], p.order))
        done.append(w)
    tiles.tile_many(jobs)
    for w in done:
        w._pending = None      # after the tiles: a reader that sees None finds them


def settle_deferred() -> None:
    """Tile every deferred weight still in use (``GGUFWeight.from_raw(..., defer=True)`` and the
    fused weights ``cat`` made of them): the end of a load, so that no weight keeps its file's
    mapping open and the first request pays for none of it. One native call, one parallel region
    for the whole load's repack (the bytes shared out over the threads), where a region a weight
    (~113 for a 1B model) waited each time for every thread. A deferred weight only ``cat`` read
    (a fused weight's part) is gone by then."""
    tile_pending(list(_DEFERRED))
    _DEFERRED.clear()


class GGUFStack:
    """[E, N, K] stacked weights (a MoE layer's experts) kept as their GGUF blocks in one buffer:
    ``stack[e]`` is expert e's [N, K] ``GGUFWeight``, a view of that buffer (no copy), which the
    kernels run like any 2-D weight. With the native build each expert's rows are tiles of 8 (an
    expert whose N is not a multiple of 8 is padded on its own), else GGUF's rows. ``sources``:
    how many of the file's tensors it holds (2 after gate and up are stacked row-wise)."""

    __slots__ = ("raw", "qtype", "shape", "tiled", "sources", "_views")

    def __init__(self, raw: torch.Tensor, qtype, shape: tuple[int, int, int], tiled: bool, sources: int = 1):
        self.raw, self.qtype, self.shape, self.tiled, self.sources = raw, qtype, shape, tiled, sources
        self._views: dict[int, GGUFWeight] = {}

    @classmethod
    def from_raw(cls, raw, qtype, shape, sources: int = 1) -> "GGUFStack":
        qtype = GGMLQuantizationType(qtype)
        e, n, k = (int(d) for d in shape)
        raw = _own_bytes(raw, qtype, e * n, k).view(e, n, -1)
        if _ext is None or not raw.is_cpu:
            return cls(raw.reshape(e * n, -1).contiguous(), qtype, (e, n, k), False, sources)
        npad = -(-n // TILE_ROWS) * TILE_ROWS
        if npad != n:
            raw = torch.cat([raw, raw.new_zeros(e, npad - n, raw.shape[2])], 1)
        return cls(tile_rows(raw.reshape(e * npad, -1), qtype), qtype, (e, n, k), True, sources)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> GGUFWeight:
        view = self._views.get(e)
        if view is None:
            n, k = self.shape[1:]
            per = self.raw.shape[0] // self.shape[0]
            view = self._views[e] = GGUFWeight(self.raw[e * per:(e + 1) * per], self.qtype, (n, k), self.tiled, self)
        return view

    def views(self) -> list[GGUFWeight]:
        """The experts' weights made so far (``stack[e]``)."""
        return list(self._views.values())

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.raw.shape[1]

    def __repr__(self) -> str:
        return f"GGUFStack({self.qtype.name}, shape={self.shape})"

    def rows(self) -> torch.Tensor:
        """GGUF's rows [E, N, row_bytes]."""
        return torch.stack([self[e].rows() for e in range(len(self))]) if self.tiled else \
            self.raw.view(*self.shape[:2], -1)

    def dequantize(self) -> torch.Tensor:
        """[E, N, K] float32, bit-exact with gguf.quants.dequantize."""
        e, n, k = self.shape
        return reference.dequantize(self.rows().reshape(e * n, -1), self.qtype, (e * n, k)).view(e, n, k)

    @staticmethod
    def cat_rows(parts: list["GGUFStack"]) -> "GGUFStack":
        """Each expert's rows of ``parts`` one after the other (gate then up): [E, sum N, K]. Parts
        must share the type, E and K."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[0] != first.shape[0] or p.shape[2] != first.shape[2] for p in parts):
            raise ValueError("GGUFStack.cat_rows: parts of different types or shapes")
        if all(p.tiled and p.shape[1] % TILE_ROWS == 0 for p in parts):
            # whole tiles per expert: each expert's tiles of gate then up are the tiles of its rows
            e, n, rb = first.shape[0], sum(p.shape[1] for p in parts), first.raw.shape[1]
            joined = tiles.weight_buffer(e * n, rb)
            torch.cat([p.raw.view(e, p.shape[1], rb) for p in parts], 1, out=joined.view(e, n, rb))
            return GGUFStack(joined, first.qtype, (e, n, first.shape[2]), True, sum(p.sources for p in parts))
        rows = torch.cat([p.rows() for p in parts], 1)
        shape = (first.shape[0], rows.shape[1], first.shape[2])
        return GGUFStack.from_raw(rows, first.qtype, shape, sum(p.sources for p in parts))
