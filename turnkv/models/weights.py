"""Weight formats: how a model's projection weights are stored and multiplied, chosen at load.

The compute dtype (``dtype``: activations, norms, RoPE tables, the native KV cache) and the
weight format are two separate choices:

- ``native``: every weight in the compute dtype, ``F.linear``. With ``dtype=float32`` this is the
  parity reference (logits within 1e-3 of transformers float32).
- ``bf16``: projection weights stored in bfloat16 and multiplied in bfloat16 (AMX / AVX-512 BF16
  GEMMs, several times faster than float32 for prefill); the result is cast back to the compute dtype.
- ``int8``: weight-only int8, one float scale per output row (symmetric). A matmul with a few rows
  (decode) runs ``aten._weight_int8pack_mm`` on the int8 bytes, which reads 4x fewer bytes than
  float32 — decode is memory-bandwidth bound. A matmul with many rows (prefill) runs a bfloat16 GEMM
  on the dequantized weight, because the int8 kernel's cost grows linearly with the rows. Both paths
  multiply the same (dequantized int8) weights; they differ only by bfloat16 rounding.
  The lm_head / tied embedding is int8 too; embedding rows are gathered from it and dequantized.

Which parameters may be packed is declared by each family (``Model.packable_weights``: attribute
names such as ``"wqkv"``; ``Model.head_weights``: the embedding / lm_head, only looked up or
multiplied by one row in prefill, which get no dense copy); a family that declares none supports
only ``native``. A tied embedding / lm_head (one Parameter under two names) is packed once.
Every projection goes through ``models.base.linear`` and every lookup through
``models.base.embedding``, which dispatch on ``PackedWeight``.

Parity (measured by bench/throughput.py's ``--parity`` and documented in the report): see
``FORMATS[...].tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# A matmul with at most this many rows uses the int8 kernel; more rows use the dense bf16 GEMM.
# Measured on AVX-512/AMX: the int8 GEMV wins up to ~6 rows (it is linear in rows).
INT8_MAX_ROWS = 6
# The int4 kernel's cost grows more slowly with rows.
INT4_MAX_ROWS = 16
INT4_GROUP = 32


@dataclass(frozen=True)
class WeightFormat:
    name: str
    layers: str | None     # packing of the projection weights (None: native)
    head: str | None       # of the lm_head (prefill multiplies it by one row only: no dense copy)
    embedding: str | None  # of the embedding table (row lookups: a format with ``lookup``)
    description: str
    tolerance: str  # the parity contract against the float32 / native reference


FORMATS: dict[str, WeightFormat] = {
    "native": WeightFormat("native", None, None, None, "weights in the compute dtype",
                           "float32: max |logit diff| <= 1e-3 vs transformers float32"),
    "bf16": WeightFormat("bf16", "bf16", "bf16", "bf16", "bfloat16 weights, bfloat16 GEMMs",
                         "TBD"),
    "int8": WeightFormat("int8", "int8", "int8", "int8",
                         "weight-only int8 (per-row scale); int8 GEMV for decode, "
                         "bf16 GEMM on the dequantized weight for prefill", "TBD"),
    "int4": WeightFormat("int4", "int4", "int8", "int8",
                         "weight-only int4 (groups of 32) projections, int8 lm_head and embedding", "TBD"),
    "int4h4": WeightFormat("int4h4", "int4", "int4", "int8",
                         "weight-only int4 (groups of 32) projections and lm_head, int8 embedding", "TBD"),
}


class PackedWeight(nn.Module):
    """A projection weight in a non-native format. ``linear``/``embedding`` in models.base call
    ``matmul``/``lookup`` for it instead of ``F.linear``/``F.embedding``."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class Bf16Weight(PackedWeight):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.register_buffer("w", w.to(torch.bfloat16).contiguous(), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.w).to(x.dtype)

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(tokens, self.w).to(dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~= q * scale[:, None]. Returns (q int8 [N, K], scale float32 [N])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Weight(PackedWeight):
    def __init__(self, w: torch.Tensor, dense: bool = True):
        """``dense``: also keep the dequantized weight in bfloat16 for many-row matmuls (prefill).
        Without it (an lm_head that prefill only calls for its last row) many-row matmuls
        dequantize block by block."""
        super().__init__()
        self.out_features, self.in_features = w.shape
        q, scale = quantize_int8(w)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)            # float32, for lookups
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        deq = (q.float() * scale[:, None]).to(torch.bfloat16) if dense else None
        self.register_buffer("dense", deq, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        xb = x.to(torch.bfloat16)
        if rows <= INT8_MAX_ROWS:
            flat = xb.reshape(rows, self.in_features).contiguous()
            out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale_bf16)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.dense is not None:
            return F.linear(xb, self.dense).to(x.dtype)
        return self._blockwise(xb).to(x.dtype)

    def _blockwise(self, xb: torch.Tensor, block: int = 8192) -> torch.Tensor:
        out = torch.empty(*xb.shape[:-1], self.out_features, dtype=torch.bfloat16, device=xb.device)
        for a in range(0, self.out_features, block):
            b = min(a + block, self.out_features)
            w = (self.q[a:b].float() * self.scale[a:b, None]).to(torch.bfloat16)
            out[..., a:b] = F.linear(xb, w)
        return out

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = F.embedding(tokens, self.q).float() * F.embedding(tokens, self.scale[:, None])
        return rows.to(dtype)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group`` inputs: w ~= q * scale + lo, q in 0..15.
    Returns (q int32 [N, K], scale [N, K/group], lo [N, K/group]) in float32.
    A GGUF Q4_0/Q4_1 block of 32 whose codes span 0..15 is recovered exactly."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, lo


class Int4Weight(PackedWeight):
    """Weight-only int4 in groups of 32 (``aten._weight_int4pack_mm_for_cpu``, bfloat16 activations).
    No row lookup: the packed layout is the kernel's, so an embedding tied to an int4 lm_head
    keeps its own int8 copy (see ``apply_format``)."""

    def __init__(self, w: torch.Tensor, dense: bool = True, group: int = INT4_GROUP):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group = group
        q, scale, lo = quantize_int4(w, group)
        # the kernel dequantizes (q - 8) * scale + zero
        zero = lo + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()   # [K/group, N, 2]
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16), persistent=False)
        deq = None
        if dense:
            deq = (q.reshape(*scale.shape, group).float() * scale[..., None] + lo[..., None])
            deq = deq.reshape(w.shape).to(torch.bfloat16)
        self.register_buffer("dense", deq, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        xb = x.to(torch.bfloat16)
        if rows <= INT4_MAX_ROWS or self.dense is None:
            flat = xb.reshape(rows, self.in_features).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return F.linear(xb, self.dense).to(x.dtype)

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError("int4 weights have no row lookup; the embedding keeps an int8 copy")


def pack(w: torch.Tensor, fmt: str, dense: bool = True) -> PackedWeight:
    if fmt == "bf16":
        return Bf16Weight(w)
    if fmt == "int8":
        return Int8Weight(w, dense=dense)
    if fmt == "int4":
        return Int4Weight(w, dense=dense)
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")


def apply_format(model: nn.Module, fmt: str) -> nn.Module:
    """Convert the family's declared weights in place (see the module docstring). A Parameter
    shared by several attributes (a tied embedding / lm_head) is packed once per packing."""
    spec = FORMATS.get(fmt)
    if spec is None:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if spec.layers is None:
        return model
    cls = type(model)
    if not cls.packable_weights:
        raise ValueError(f"{cls.__name__} supports only the native weight format")
    roles = {**{n: (spec.layers, True) for n in cls.packable_weights},
             **{n: (spec.head, False) for n in cls.head_weights},
             **{n: (spec.embedding, False) for n in cls.embedding_weights}}
    packed: dict[tuple[int, str, bool], PackedWeight] = {}
    for module in list(model.modules()):
        for name in [n for n in list(module._parameters) if n in roles]:
            p = module._parameters[name]
            if p is None:
                continue
            kind, dense = roles[name]
            key = (id(p), kind, dense)
            if key not in packed:
                packed[key] = pack(p.data, kind, dense=dense)
            del module._parameters[name]
            setattr(module, name, packed[key])
    return model


def load_model(cls, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
               weights: str = "native"):
    """Build ``cls`` from a checkpoint in the compute ``dtype`` and convert its weights to ``weights``.
    For non-native formats the family is built in float32 first so quantization sees exact weights."""
    if weights not in FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of {', '.join(FORMATS)}")
    model = cls.from_checkpoint(config, tensors, dtype)
    return apply_format(model, weights)
