"""GGUF tensor data -> torch tensors: dequantized (bit for bit as `gguf.quants` gives, the same
float32 arithmetic) or kept as the file's raw quantized rows. Quant constants and the block
dequantizers come from the `gguf` package."""

from __future__ import annotations

import mmap
from pathlib import Path

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelLoadError
from .reader import TensorInfo

_CHUNK_ELEMENTS = 1 << 22


def _q8_0_rows(raw: np.ndarray) -> torch.Tensor:
    # Same float32 arithmetic as gguf.quants.Q8_0 (f16 scale -> f32, times int8 -> f32),
    # in torch so it runs on all cores: the Gemma embedding is 167M values.
    rows = raw.shape[0]
    blocks = torch.from_numpy(raw).view(-1, 34)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (q * d).view(rows, -1)


def dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """raw: uint8 [rows, row_bytes] -> float32 [rows, row_elements]."""
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16)).float()
    if qtype == GGMLQuantizationType.Q8_0:
        return _q8_0_rows(raw)
    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None or not hasattr(quant, "dequantize_blocks"):
        raise NotImplementedError(qtype.name)
    # Whole chunks at once through the package's block kernel (its dequantize()
    # loops over groups of 16 rows in Python); elementwise, so identical values.
    quant.init_grid()
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = quant.dequantize_blocks(raw.reshape(-1, type_size))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1))


def dequantize(buf: mmap.mmap, info: TensorInfo, dtype: torch.dtype, path: Path) -> torch.Tensor:
    """Dequantize one tensor into a fresh tensor of `dtype`, a row chunk at a time."""
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    row_elems = info.shape[-1]
    n_rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    row_bytes = row_elems // block * type_size
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(n_rows, row_bytes)
    out = torch.empty((n_rows, row_elems), dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // row_elems)
    try:
        for start in range(0, n_rows, step):
            out[start : start + step] = dequantize_rows(raw[start : start + step], info.qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor '{info.name}' uses quantization {info.qtype.name}, which cannot be dequantized"
        ) from None
    return out.view(info.shape)


# Types held as float (never kept quantized): the matmul of a float tensor is the native one.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                         GGMLQuantizationType.F64})


def raw_rows(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """A 2-D (or stacked 3-D) tensor's stored bytes as a uint8 tensor [rows, row_bytes], a stack's
    experts' rows one after the other: a view of the file's mapping, no copy (what keeps it, a
    weight's tiles, is written from it; the mapping closes when no view is left)."""
    rows = int(np.prod(info.shape[:-1]))
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1))


def expert_stack(name: str, shape) -> bool:
    """Whether GGUF tensor ``name`` is a MoE layer's stacked experts [E, out, in]."""
    return len(shape) == 3 and "_exps." in name


def keeps_blocks(name: str, info: TensorInfo) -> bool:
    """Whether ``keep_quantized`` keeps tensor ``name`` as its blocks (unless its family must
    transform it): a 2-D tensor or an expert stack of a type the kernels run."""
    return gguf_kernel_supports(info.qtype) and (len(info.shape) == 2 or expert_stack(name, info.shape))


def gguf_kernel_supports(qtype: GGMLQuantizationType) -> bool:
    """Whether turnkv.kernels.GGUFWeight runs this quantization type."""
    from ... import kernels

    return qtype in kernels.SUPPORTED
