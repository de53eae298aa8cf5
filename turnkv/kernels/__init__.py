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

import functools
import glob
import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import reference

__all__ = ["GGUFWeight", "GGUFStack", "describe_types", "kernel_info", "native_available", "ISAS", "SUPPORTED", "tile_rows", "untile_rows"]

SUPPORTED = reference.SUPPORTED
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


# ------------------------------------------------------------------ tiles of 8 rows
#
# The native kernels read a weight as tiles of TILE_ROWS rows: tile t holds rows 8t..8t+7 (the
# last tile padded with zero rows, whose blocks have scale 0), block after block; block b of a
# tile is its 8 rows' block b cut into fields (2- or 4-byte pieces, and MXFP4's 1-byte scale:
# scales, mins, high bits, the quants as 4-byte groups), each field of the 8 rows side by side:
#     Q4_1 block of a tile = d[8] (16 B) | m[8] (16 B) | group 0 of rows 0..7 (32 B) | ... group 3
# so one 32-byte load gives a group of all 8 rows (row r in bytes 4r..4r+3), the layout the dot
# products want, where GGUF's rows needed an 8x8 transpose per block (docs/kernels.md, "Layouts").
# The field at byte o of a row's block starts at byte 8 * o of the tile's block. The bytes are
# GGUF's own, only moved: a tile is exactly 8 rows' bytes.
TILE_ROWS = 8
_Q = GGMLQuantizationType
# a block's fields in GGUF order, as byte widths (csrc/common.h, block_fields)
_FIELDS = {
    _Q.Q4_0: (2,) + (4,) * 4,                                 # d, qs
    _Q.Q4_1: (2, 2) + (4,) * 4,                               # d, m, qs
    _Q.Q5_0: (2, 4) + (4,) * 4,                               # d, qh, qs
    _Q.Q5_1: (2, 2, 4) + (4,) * 4,                            # d, m, qh, qs
    _Q.Q8_0: (2,) + (4,) * 8,                                 # d, qs
    _Q.Q4_K: (2, 2) + (4,) * 3 + (4,) * 32,                   # d, dmin, scales, qs
    _Q.Q5_K: (2, 2) + (4,) * 3 + (4,) * 8 + (4,) * 32,        # d, dmin, scales, qh, qs
    _Q.Q6_K: (4,) * 32 + (4,) * 16 + (4,) * 4 + (2,),         # ql, qh, scales, d
    _Q.IQ4_NL: (2,) + (4,) * 4,                               # d, qs
    _Q.IQ4_XS: (2, 2, 4) + (4,) * 32,                         # d, scales_h, scales_l, qs
    _Q.MXFP4: (1,) + (4,) * 4,                                # e (E8M0), qs
    _Q.Q2_K: (4,) * 4 + (4,) * 16 + (2, 2),                   # scales, qs, d, dmin
    _Q.Q3_K: (4,) * 8 + (4,) * 16 + (4,) * 3 + (2,),          # hmask, qs, scales, d
    _Q.IQ2_XXS: (2,) + (4,) * 16,                             # d, qs (indices, signs + scale)
    _Q.IQ2_XS: (2,) + (4,) * 16 + (4,) * 2,                   # d, qs, scales
    _Q.IQ2_S: (2,) + (4,) * 8 + (4,) * 8 + (4,) * 2 + (4,) * 2,   # d, qs, signs, qh, scales
    _Q.IQ3_XXS: (2,) + (4,) * 16 + (4,) * 8,                  # d, qs, scales and signs
    _Q.IQ3_S: (2,) + (4,) * 16 + (4,) * 2 + (4,) * 8 + (4,),  # d, qs, qh, signs, scales
    _Q.F16: (2,),                                             # one value a "block"
    _Q.BF16: (2,),
}


def _tile_fields(rows: torch.Tensor, qtype) -> torch.Tensor:
    """What ``tile_rows`` does, as tensor ops on any dtype (built once per row size, on positions)."""
    fields = _FIELDS[GGMLQuantizationType(qtype)]
    n, rb = rows.shape
    bb = sum(fields)
    blocks = rows.reshape(n // TILE_ROWS, TILE_ROWS, rb // bb, bb).transpose(1, 2)   # [tiles, nb, 8, bb]
    parts, off = [], 0
    for w in fields:
        parts.append(blocks[..., off:off + w].reshape(n // TILE_ROWS, rb // bb, TILE_ROWS * w))
        off += w
    return torch.cat(parts, -1).reshape(n, rb)


def _unit(qtype) -> int:
    """The bytes a tile moves as one: 2 where every field is 2 or 4 bytes wide, 1 for MXFP4 (its
    1-byte scale; a row may then have an odd size)."""
    return 1 if any(w % 2 for w in _FIELDS[GGMLQuantizationType(qtype)]) else 2


@functools.lru_cache(maxsize=None)
def _tile_index(qtype, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, inverse) gathers over a tile's units (``_unit`` bytes): unit j of a tile comes
    from unit forward[j] of its 8 rows, and back. One numpy take per weight moves its bytes at
    memory speed, where field-by-field tensor ops took seconds per layer of a 1B model."""
    u = _unit(qtype)
    units = torch.arange(TILE_ROWS * row_bytes // u).view(TILE_ROWS, row_bytes // u)
    forward = _tile_fields(units.repeat_interleave(u, 1), qtype).reshape(-1)[::u].numpy().copy()
    return forward, np.argsort(forward)


def _gather_units(src: torch.Tensor, index: np.ndarray, rows: int) -> torch.Tensor:
    """``src`` [tiles * 8, row_bytes] uint8, each tile's units gathered by ``index``."""
    rb = src.shape[1]
    out = torch.empty((rows, rb), dtype=torch.uint8)
    view = np.int16 if TILE_ROWS * rb == 2 * index.size else np.uint8
    np.take(src.contiguous().numpy().view(view).reshape(rows // TILE_ROWS, -1), index, axis=1,
            out=out.numpy().view(view).reshape(rows // TILE_ROWS, -1), mode="clip")
    return out


def tile_rows(rows: torch.Tensor, qtype) -> torch.Tensor:
    """GGUF rows [N, row_bytes] -> their tiles [ceil(N / 8) * 8, row_bytes]."""
    n, rb = rows.shape
    npad = -(-n // TILE_ROWS) * TILE_ROWS
    if npad != n:
        rows = torch.cat([rows, rows.new_zeros(npad - n, rb)])
    return _gather_units(rows, _tile_index(GGMLQuantizationType(qtype), rb)[0], npad)


def untile_rows(tiles: torch.Tensor, qtype, n: int) -> torch.Tensor:
    """The inverse of ``tile_rows``: GGUF's rows [n, row_bytes]."""
    npad, rb = tiles.shape
    rows = _gather_units(tiles, _tile_index(GGMLQuantizationType(qtype), rb)[1], npad)
    return rows if n == npad else rows[:n].contiguous()


def _own_bytes(raw, qtype: GGMLQuantizationType, rows: int, k: int) -> torch.Tensor:
    """``raw`` (numpy or torch uint8) as a torch uint8 tensor [rows, row_bytes] that owns its
    bytes, after checking that rows of ``k`` values are whole blocks of ``qtype``."""
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


@functools.lru_cache(maxsize=None)
def _row_gather(qtype, row_bytes: int) -> torch.Tensor:
    """[8, row_bytes] int64: where byte j of row i of a tile lies in that tile's bytes (the
    inverse of ``tile_rows`` for one row, as offsets from the tile's start)."""
    u = _unit(qtype)
    inverse = torch.from_numpy(_tile_index(GGMLQuantizationType(qtype), row_bytes)[1])
    return torch.stack([u * inverse + i for i in range(u)], 1).reshape(TILE_ROWS, row_bytes)


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
    the ``GGUFStack`` whose bytes ``raw`` views (one expert of a stack), else None."""

    __slots__ = ("raw", "qtype", "shape", "tiled", "base")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int], tiled: bool = False,
                 base: "GGUFStack | None" = None):
        self.raw = raw
        self.qtype = qtype
        self.shape = shape
        self.tiled = tiled
        self.base = base

    @classmethod
    def from_raw(cls, raw, qtype, shape) -> "GGUFWeight":
        qtype = GGMLQuantizationType(qtype)
        n, k = int(shape[0]), int(shape[1])
        raw = _own_bytes(raw, qtype, n, k).contiguous()
        if _ext is not None and raw.is_cpu:   # the layout the native kernels read
            return cls(tile_rows(raw, qtype), qtype, (n, k), tiled=True)
        return cls(raw, qtype, (n, k))

    def rows(self) -> torch.Tensor:
        """GGUF's own rows [N, row_bytes] (a copy when tiled)."""
        return untile_rows(self.raw, self.qtype, self.shape[0]) if self.tiled else self.raw

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.raw.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.raw.shape[1]

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
            # whole tiles: the parts' tiles one after the other are the tiles of their rows
            return GGUFWeight(torch.cat([p.raw for p in parts], 0), q, (n, k), tiled=True)
        raw = torch.cat([p.rows() for p in parts], 0)
        return GGUFWeight.from_raw(raw, q, (n, k))


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
        rows = torch.cat([p.rows() for p in parts], 1)
        shape = (first.shape[0], rows.shape[1], first.shape[2])
        return GGUFStack.from_raw(rows, first.qtype, shape, sum(p.sources for p in parts))
