"""GGUF quantized weights run as stored: int8 activations, integer dot products.

`GGUFWeight` holds a tensor's GGUF bytes ([N, row_bytes] uint8, GGUF's own block layout) and
multiplies float activations with them through the native extension (`csrc/gguf_matmul.cpp`,
built by `python -m turnkv.kernels.build`) or, when that is missing, through the pure-PyTorch
reference (`reference.py`), which computes the very same numbers (docs/kernels.md).

`TURNKV_KERNEL_ISA=scalar|avx2|avx512|avx512vnni` forces a lower native path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import reference

__all__ = ["GGUFWeight", "kernel_info", "native_available", "ISAS", "SUPPORTED"]

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
    return f"native {ISAS[_isa]}"


def _isa_index(isa: str | None) -> int:
    if isa is None:
        return _isa
    i = ISAS.index(isa)
    if i > int(_ext.best_isa()):
        raise ValueError(f"ISA {isa} not supported by this CPU (best: {ISAS[int(_ext.best_isa())]})")
    return i


class GGUFWeight:
    """A [N, K] weight kept as its GGUF blocks (rows of K/block_size blocks, GGUF byte layout)."""

    __slots__ = ("raw", "qtype", "shape")

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        self.raw = raw
        self.qtype = qtype
        self.shape = shape

    @classmethod
    def from_raw(cls, raw, qtype, shape) -> "GGUFWeight":
        qtype = GGMLQuantizationType(qtype)
        if qtype not in SUPPORTED:
            raise NotImplementedError(f"GGUFWeight: {qtype.name} not supported")
        n, k = int(shape[0]), int(shape[1])
        block, size = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise ValueError(f"GGUFWeight: K={k} not a multiple of {qtype.name}'s block {block}")
        row_bytes = k // block * size
        if isinstance(raw, np.ndarray):
            arr = np.ascontiguousarray(raw, dtype=np.uint8)
            if not arr.flags.writeable:  # e.g. a view of a file's mmap: own the bytes
                arr = arr.copy()
            raw = torch.from_numpy(arr)
        if raw.dtype != torch.uint8:
            raise TypeError(f"GGUFWeight: raw must be uint8, got {raw.dtype}")
        raw = raw.reshape(n, row_bytes).contiguous()
        return cls(raw, qtype, (n, k))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

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
            if x2.dtype != torch.float32:
                x2 = x2.float()
            y = _ext.gguf_matmul(x2.contiguous(), self.raw, int(self.qtype), n, k, _isa_index(isa))
        else:
            if native is None and _ext is None:
                _warn_fallback()
            y = reference.matmul(x2, self.raw, self.qtype, n, k)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.reshape(*lead, n)


    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, bit-exact with gguf.quants.dequantize."""
        return reference.dequantize(self.raw, self.qtype, self.shape)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Embedding rows: ids [...] -> [..., K] dequantized (bit-exact), in dtype."""
        flat = ids.reshape(-1).long()
        rows = self.raw.index_select(0, flat)
        out = reference.dequantize(rows, self.qtype, (flat.numel(), self.shape[1]))
        return out.to(dtype).reshape(*ids.shape, self.shape[1])

    def take_rows(self, index: torch.Tensor) -> "GGUFWeight":
        """Rows `index` (a permutation or selection) as a new weight; the blocks move unchanged."""
        index = torch.as_tensor(index).reshape(-1).long()
        return GGUFWeight(self.raw.index_select(0, index).contiguous(), self.qtype, (index.numel(), self.shape[1]))

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Concatenate along N (fused qkv / gate-up). Parts must share qtype and K."""
        if not parts:
            raise ValueError("GGUFWeight.cat: no parts")
        q, k = parts[0].qtype, parts[0].shape[1]
        for p in parts:
            if p.qtype != q or p.shape[1] != k:
                raise ValueError(f"GGUFWeight.cat: mixed parts ({q.name}, K={k}) vs ({p.qtype.name}, K={p.shape[1]})")
        raw = torch.cat([p.raw for p in parts], 0)
        return GGUFWeight(raw, q, (raw.shape[0], k))
