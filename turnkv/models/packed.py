"""Packed weight formats (bf16, weight-only int8 / int4, the rescored lm_head): how a projection
weight other than a native Parameter is stored and multiplied. models/weights.py says which
format packs what, and why these choices."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# A matmul with at most this many rows uses the packed kernel; more rows use the dense GEMM
# (``_dense_matmul``); both compute the same numbers, so the choice is only about speed.
# Measured on AVX-512/AMX: the int8 GEMV wins up to ~6 rows (its cost is linear in rows), the
# int4 one up to ~16.
INT8_MAX_ROWS = 6
INT4_MAX_ROWS = 16
INT4_GROUP = 32          # = GGUF Q4_0/Q4_1 blocks, so those are held exactly
INT4X2_GROUP = 32        # two-pass projections: groups of 64 cost 1.6x the logit error
# lm_head: the packed kernel only nominates; the top RESCORE_TOP logits of each row are recomputed
# in float32 (RescoredHead); above RESCORE_MAX_ROWS rows, all of them. The int4 heads' logit error
# is ~0.3 (mean) and up to ~5: measured over ~4,900 positions of real text on the bundled models,
# the true argmax ranked at worst 18th (groups of 32) in the int4 logits, so 256 candidates leave
# a >10x margin.
RESCORE_TOP = 256
RESCORE_MAX_ROWS = 16
INT4_HEAD_GROUP = 32     # groups of 64: worst rank 59 on SmolLM2, too close to RESCORE_TOP
INT4_K_ALIGN = 64        # int4 packings need K to be a multiple of this; other shapes use int8
INT4X2_HEAD_GROUP = 64   # the int4x2 format's two-pass lm_head: 20% faster than 32, error still small
INT4_KINDS = ("int4", "int4x2", "int4-head", "int4x2-head", "auto")   # the packings of pack() on int4
# Quantize this many rows at a time: temporaries stay small and in cache.
ROW_BLOCK = 4096



class PackedWeight(nn.Module):
    """A weight in a non-native format. ``models.base.linear`` / ``embedding`` call ``matmul`` /
    ``lookup`` for it instead of ``F.linear`` / ``F.embedding``."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} has no row lookup")


def _row_blocks(n: int):
    for a in range(0, n, ROW_BLOCK):
        yield a, min(a + ROW_BLOCK, n)


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
    """Symmetric per-row int8: w ~= q * scale[:, None]. Returns (q int8 [N, K], scale float32 [N],
    each scale a bfloat16 value)."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int8)
    scale = torch.empty(N)
    for a, b in _row_blocks(N):
        blk = w[a:b].float()
        # the scale as the kernel will see it (bfloat16), so the codes are rounded against it
        s = blk.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0).to(torch.bfloat16).float()
        q[a:b] = torch.round(blk / s[:, None]).clamp_(-127, 127)
        scale[a:b] = s
    return q, scale


def _dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The many-row path: a bfloat16 GEMM on the kernel's dequantized weights (rounded to
    bfloat16; ``w``). It agrees with the packed kernel to bfloat16 rounding, not bit for bit:
    bfloat16 activations put a cold run and a reused run ~2^-8 apart whichever path a row takes
    (a float32 GEMM on the exact kernel weights was measured: it reproduces a kernel call bit for
    bit, yet on a 30-layer model the two runs still end up at the same bfloat16 noise floor, at
    half the prefill speed)."""
    return F.linear(x.to(torch.bfloat16), w).to(x.dtype)


class Int8Weight(PackedWeight):
    def __init__(self, w: torch.Tensor, dense: bool = True):
        """``dense``: keep the kernel's dequantized weight (bfloat16) for many-row matmuls (prefill).
        Without it (an lm_head) a many-row matmul dequantizes block by block."""
        super().__init__()
        self.out_features, self.in_features = w.shape
        q, scale = quantize_int8(w)
        self.register_buffer("q", q, persistent=False)
        # the kernel takes bfloat16 scales: that rounded scale is the one every path uses
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("scale", self.scale_bf16.float(), persistent=False)
        self.register_buffer("dense", self._dequantized() if dense else None, persistent=False)

    def _dequantized(self, a: int = 0, b: int | None = None) -> torch.Tensor:
        b = self.out_features if b is None else b
        return (self.q[a:b].float() * self.scale[a:b, None]).to(torch.bfloat16)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # torch's int8 kernel reads 16 input features at a time: other widths crash it (segfault)
        if rows <= INT8_MAX_ROWS and self.in_features % 16 == 0:
            flat = x.to(torch.bfloat16).reshape(rows, self.in_features).contiguous()
            out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale_bf16)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.dense is not None:
            return _dense_matmul(x, self.dense)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for a, b in _row_blocks(self.out_features):
            out[..., a:b] = _dense_matmul(x, self._dequantized(a, b))
        return out

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = F.embedding(tokens, self.q).float() * F.embedding(tokens, self.scale[:, None])
        return rows.to(dtype)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group`` inputs: w ~= q * scale + lo, q in 0..15.
    Returns (q int32 [N, K], scale [N, K/group], lo [N, K/group]), float32. A GGUF Q4_0/Q4_1
    block of 32 whose codes span 0..15 is recovered exactly."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int32)
    scale = torch.empty(N, K // group)
    lo = torch.empty(N, K // group)
    for a, b in _row_blocks(N):
        g = w[a:b].float().reshape(b - a, K // group, group)
        mn, mx = g.amin(-1), g.amax(-1)
        s = (mx - mn).div_(15).clamp_(min=1e-10)
        q[a:b] = torch.round((g - mn[..., None]).div_(s[..., None])).clamp_(0, 15).reshape(b - a, K)
        scale[a:b], lo[a:b] = s, mn
    return q, scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    g = q.reshape(*scale.shape, group).float().mul_(scale[..., None]).add_(lo[..., None])
    return g.reshape(q.shape)


def int4_exact(w: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               rel: float = 1e-3) -> bool:
    """True when ``w`` already lies on the int4 grid (a GGUF Q4_0/Q4_1 tensor; most Q4_K groups do
    not): every weight within ``rel`` quantization steps of its dequantized value."""
    q, scale, lo = quantized
    group = q.shape[1] // scale.shape[1]
    for a, b in _row_blocks(q.shape[0]):
        err = (dequantize_int4(q[a:b], scale[a:b], lo[a:b]) - w[a:b].float()).abs_()
        if not bool((err.reshape(b - a, -1, group).amax(-1) <= rel * scale[a:b]).all()):
            return False
    return True


class Int4Weight(PackedWeight):
    """``passes=2``: the weight is quantized to int4, then the residual is quantized to int4 again
    (same groups) and both codes run as one int4 matmul over [x, x] (K doubled): ~1.1 bytes per
    weight, the error of a ~8-bit *grouped* quantizer (1.5-2.5x below per-row int8 on the bundled
    Gemma weights), and the int4 kernel, which streams faster than the int8 one."""

    def __init__(self, w: torch.Tensor, dense: bool = True, group: int = INT4_GROUP, passes: int = 1,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group, self.passes = group, passes
        # the kernel computes (q - 8) * scale + zero in float32 from bfloat16 scale and zero
        q, sz = self._kernel_codes(*(quantized if quantized is not None else quantize_int4(w, group)))
        deq = self._kernel_weights(q, sz)
        if passes == 2:    # the residual against what the kernel really multiplies by (bf16 scales)
            q2, sz2 = self._kernel_codes(*quantize_int4(w.float() - deq, group))
            deq += self._kernel_weights(q2, sz2)
            q, sz = torch.cat([q, q2], 1), torch.cat([sz, sz2], 1)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False)
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous(), persistent=False)  # [K/g, N, 2]
        self.register_buffer("dense", deq.to(torch.bfloat16) if dense else None, persistent=False)

    @staticmethod
    def _kernel_codes(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor):
        """codes and bfloat16 [N, K/g, 2] (scale, zero) as the kernel takes them"""
        return q, torch.stack([scale, lo + 8 * scale], dim=-1).to(torch.bfloat16)

    def _kernel_weights(self, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """The float32 weights the kernel multiplies by, [N, K]."""
        N, K, g = self.out_features, self.in_features, self.group
        s, z = sz[..., 0].float(), sz[..., 1].float()
        return ((q.float() - 8).view(N, K // g, g) * s[..., None] + z[..., None]).view(N, K)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= INT4_MAX_ROWS or self.dense is None:
            flat = x.to(torch.bfloat16).reshape(rows, self.in_features)
            flat = torch.cat([flat, flat], 1) if self.passes == 2 else flat.contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return _dense_matmul(x, self.dense)


class RescoredHead(PackedWeight):
    """An lm_head whose packed kernel (bfloat16 output: logits in steps of 2^-8 relative, where
    ties and one-step flips decide greedy picks) only nominates candidates: the ``RESCORE_TOP``
    highest logits of each row are recomputed in float32 from the unquantized table (for a tied
    head, the embedding table already in memory). The greedy pick and the head of the
    distribution are then float32-exact and independent of the path a row took; the tail keeps the
    packed values. Many rows (``logits="all"``) use the float32 table throughout. The logits are
    float32 whatever the compute dtype: rounding the rescored values back to bfloat16 would bring
    the ties back."""

    def __init__(self, inner: PackedWeight, exact: torch.Tensor, top: int = RESCORE_TOP):
        super().__init__()
        self.inner, self.top = inner, top
        self.out_features, self.in_features = exact.shape
        self.register_buffer("exact", exact, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > RESCORE_MAX_ROWS:
            return F.linear(x.float(), self.exact)
        logits = self.inner.matmul(x).float().reshape(rows, self.out_features)
        xf = x.float().reshape(rows, 1, self.in_features)
        top = logits.topk(min(self.top, self.out_features), dim=-1).indices            # [rows, k]
        exact = (self.exact[top] @ xf.transpose(1, 2)).squeeze(-1)                      # [rows, k]
        logits.scatter_(1, top, exact)
        return logits.view(*x.shape[:-1], self.out_features)

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.lookup(tokens, dtype)



def pack(w: torch.Tensor, kind: str, dense: bool = True) -> PackedWeight:
    """``w`` (float32 [N, K]) in the packing ``kind``: bf16, int8, int4, int4x2, int4-head (the
    nominating int4 of a RescoredHead), int4x2-head (two-pass, groups of 64) or auto (int4 where
    that is lossless, int4x2 elsewhere). int4 packings need K to be a multiple of
    ``INT4_K_ALIGN``; other shapes fall back to int8."""
    if kind == "bf16":
        return Bf16Weight(w)
    if kind == "int8" or (kind in INT4_KINDS and w.shape[1] % INT4_K_ALIGN):
        return Int8Weight(w, dense=dense)
    if kind == "int4x2":
        return Int4Weight(w, dense=dense, group=INT4X2_GROUP, passes=2)
    if kind == "int4-head":
        return Int4Weight(w, dense=dense, group=INT4_HEAD_GROUP)
    if kind == "int4x2-head":
        return Int4Weight(w, dense=dense, group=INT4X2_HEAD_GROUP, passes=2)
    if kind == "int4":
        return Int4Weight(w, dense=dense)
    if kind == "auto":
        # look at the first rows before quantizing everything
        if int4_exact(w[:64], quantize_int4(w[:64])):
            quantized = quantize_int4(w)
            if int4_exact(w, quantized):
                return Int4Weight(w, dense=dense, quantized=quantized)
        return Int4Weight(w, dense=dense, group=INT4X2_GROUP, passes=2)
    raise ValueError(f"unknown weight packing {kind!r}")

