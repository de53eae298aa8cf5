"""Weight formats: how a model's projection weights are stored and multiplied, chosen at load.

The compute dtype (``dtype``: activations, norms, RoPE tables, the native KV cache) and the
weight format (``weights``) are two separate choices, made by ``load_model``:

- ``native``: every weight in the compute dtype, ``F.linear``. With ``dtype=float32`` this is the
  parity reference (bit-identical to transformers float32 on the bundled models).
- ``bf16``: weights stored in bfloat16 and multiplied in bfloat16 (AMX / AVX-512 BF16 GEMMs,
  several times faster than float32 for prefill); results are cast back to the compute dtype.
- ``int8``: weight-only int8, one scale per output row (symmetric). A matmul with a few rows
  (decode) runs ``aten._weight_int8pack_mm`` on the int8 bytes: decode is memory-bandwidth bound
  and reads 4x fewer bytes than float32. A matmul with many rows (prefill) runs a bfloat16 GEMM on
  the kernel's dequantized weight (kept beside it in bfloat16), since the int8 kernel's cost grows
  linearly with rows. Both paths agree to bfloat16 rounding. Scales are bfloat16 values (what the
  kernel takes), and the codes are rounded against them.
- ``int4x2``: two-pass int4 (``Int4Weight(passes=2)``): the weight in int4 per group of 32 inputs
  (64 for the lm_head), plus its residual in int4 again, run as one
  ``aten._weight_int4pack_mm_for_cpu`` over [x, x].
  About the bytes of int8 but a grouped ~8-bit quantizer: on the bundled Gemma its effect on the
  logits is about that of the bfloat16 rounding of the matmul inputs (per-row int8: ~3x worse),
  and the int4 kernel streams ~15-25% faster than the int8 one.
- ``int4``: single-pass int4 projections (8x fewer bytes than float32).
- ``auto``: per projection, int4 where the weights already lie on a 4-bit grid — a GGUF Q4_0 /
  Q4_1 tensor's codes are recovered exactly (its scales up to their bfloat16 rounding) — and
  int4x2 elsewhere.

``int4`` and ``auto`` store the lm_head in single-pass int4 (groups of 32): there it only
nominates candidates for the float32 rescoring below, and it is the largest matrix of a small
model (Gemma 3's 262k rows: half of its decode step in two-pass int4). The logits below the 256
rescored then carry int4 error, which sampling at temperature 1 sees (docs/weights.md: ~2% total
variation from the exact distribution, the same order as the ~1-1.7% that auto's projections
already cause); ``int4x2`` keeps a two-pass head for a tail at its ~8-bit precision.

Every packed lm_head is a ``RescoredHead``: the kernel's logits are bfloat16 (steps of 2^-8
relative, where ties would decide greedy picks) and quantized, so the top ``RESCORE_TOP`` (256)
logits of each row are recomputed in float32 from the unquantized table (a tied head's embedding
table, which stays in memory anyway). The greedy pick is float32-exact whenever the true argmax is
among the kernel's 256 best (the measured margin is at ``RESCORE_TOP``); logits below the 256th
keep the packed values, which only sampling beyond the top 256 can see.

Exactness: bfloat16 activations put two runs of the same tokens whose rows took different paths
(a long prefill chunk vs decode or a short suffix) ~2^-8 apart, so a reused run matches the cold
run to that precision, and greedy tokens match except at near-ties of that size; native float32 is
the format held to float32 noise (docs/weights.md).

Embedding tables stay in the compute dtype in every format but ``bf16``: a lookup reads only the
rows of the new tokens, so their size costs memory, not speed (and Gemma's scaled embedding is
the most quantization-sensitive tensor). A tied lm_head is then packed separately.

The packed kernels take bfloat16 activations: with ``dtype=float32`` the residual stream, norms,
attention and KV cache stay float32 and only the matmul inputs are rounded to bfloat16.

Which parameters may be packed is declared by each family (``Model.packable_weights``: the
projections, only used through ``models.base.linear``; ``Model.head_weights``: the lm_head,
multiplied by one row in prefill, so no dense copy; ``Model.embedding_weights``: tables only used
through ``models.base.embedding``); a family that declares none supports only ``native``. A
Parameter shared by two names in the same role is packed once. Quantization always starts from
the float32 checkpoint tensors, whatever the compute dtype.

``gguf``: the GGUF file's own quantized blocks, run by the native kernels of ``turnkv.kernels``
(``GGUFWeight``: activations quantized to int8 per block, integer dot products, the same
reduction order whatever the number of rows). No float copy of a quantized tensor is made: the
loader hands over the raw blocks (``load_checkpoint(..., keep_quantized=True)``) and the family
is built around meta-device placeholders for them (``_build_with_placeholders``), whose
``torch.cat`` fusions (q/k/v, gate/up) are traced so the fused weight is ``GGUFWeight.cat`` of the
same parts in the same order. Parts of different quantization types (Gemma 3's Q4_K_M mixes
Q5_0 q/k with a Q8_0 v) stay separate ``GGUFWeight``s run one after the other into one output
(``GGUFPacked`` with several parts): still the GGUF's blocks, one activation quantization per
part. The lm_head is a plain ``GGUFWeight`` matmul (the GGUF's head is the model's head; float32
logits whatever the compute dtype); a quantized embedding table is read with ``lookup`` (the
rows dequantized). Tensors stored as F32/F16/BF16 stay native. HF folders have no GGUF blocks:
``gguf`` on one is an error (``load_checkpoint`` / ``load_model``).

Parity tolerances (against transformers float32; bench/throughput.py prints them): see
``FORMATS[...].tolerance``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

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


@dataclass(frozen=True)
class WeightFormat:
    name: str
    layers: str | None     # packing of the projections (None: native)
    head: str | None       # of the lm_head
    embedding: str | None  # of the embedding table (needs row lookups)
    description: str
    tolerance: str         # the parity contract, against transformers float32


FORMATS: dict[str, WeightFormat] = {
    "native": WeightFormat(
        "native", None, None, None, "weights in the compute dtype",
        "dtype=float32: max |logit diff| <= 1e-3 vs transformers float32 (measured 0.0)"),
    "bf16": WeightFormat(
        "bf16", "bf16", "bf16", "bf16", "bfloat16 weights and GEMMs",
        "bfloat16 rounding of weights and matmul inputs"),
    "int8": WeightFormat(
        "int8", "int8", "int8", None, "weight-only int8 (per-row scales)",
        "per-row requantization: ~3x the error of int4x2 on the bundled Gemma"),
    "int4x2": WeightFormat(
        "int4x2", "int4x2", "int4x2-head", None,
        "two-pass int4 (~8-bit grouped) everywhere, lm_head included",
        "weight error below the bfloat16 rounding of the matmul inputs"),
    "int4": WeightFormat(
        "int4", "int4", "int4-head", None,
        "weight-only int4 projections (groups of 32); int4 lm_head, top logits rescored",
        "lossless on Q4_0/Q4_1 projections; lossy (greedy drifts) on anything else"),
    "auto": WeightFormat(
        "auto", "auto", "int4-head", None,
        "int4 projections where lossless, int4x2 elsewhere; int4 lm_head, top logits rescored",
        "as int4x2, or better where int4 was lossless (SmolLM2's Q4_1 projections)"),
    "gguf": WeightFormat(
        "gguf", "gguf", "gguf", "gguf",
        "the GGUF's own quantized blocks (native kernels: int8 activations, integer dot products)",
        "the GGUF's weights exactly; int8 activations: mean NLL within 0.01 nats/token of float32 native"),
}
GGUF_FORMAT = "gguf"
log = logging.getLogger("turnkv.weights")


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


class GGUFPacked(PackedWeight):
    """A weight held as the GGUF's quantized blocks (``turnkv.kernels.GGUFWeight``): one, or
    several concatenated along the output rows (a fused weight whose parts have different
    quantization types; each part runs its own kernel into its slice of the output).
    ``float_out``: the lm_head, whose logits are float32 whatever the compute dtype."""

    def __init__(self, parts: list, float_out: bool = False):
        super().__init__()
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("GGUFPacked needs parts with one common K")
        self.parts = list(parts)
        self.float_out = float_out
        self.out_features = sum(int(p.shape[0]) for p in self.parts)
        self.in_features = int(self.parts[0].shape[1])

    @property
    def qtypes(self) -> list[str]:
        return [getattr(p.qtype, "name", str(p.qtype)) for p in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def extra_repr(self) -> str:
        return f"{self.out_features}x{self.in_features}, {'+'.join(self.qtypes)}"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_out and x.dtype != torch.float32:
            x = x.float()
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if len(self.parts) == 1:
            out = self.parts[0].matmul(flat)
        else:
            out = torch.cat([p.matmul(flat) for p in self.parts], dim=-1)
        return out.view(*x.shape[:-1], self.out_features)

    ROW_CACHE_BYTES = 16 << 20   # dequantized embedding rows kept for decode steps (per table)
    ROW_CACHE_TOKENS = 8         # lookups of at most this many tokens go through them

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows, dequantized exactly. A decode step's few rows come from a small cache of
        rows already dequantized (the same values): a lookup's dozen small ops cost ~0.1 ms in a
        decode step, where the layers before it have evicted what they touch, about 3% of a
        one-sequence SmolLM2 step."""
        if len(self.parts) != 1:
            raise TypeError("a row lookup needs a single GGUF table")
        flat = tokens.reshape(-1)
        if flat.numel() > self.ROW_CACHE_TOKENS or flat.device.type != "cpu":
            return self.parts[0].lookup(flat, dtype).view(*tokens.shape, self.in_features)
        rows = self.__dict__.setdefault("_rows", {})
        ids = flat.tolist()
        have = {i: rows.get((i, dtype)) for i in dict.fromkeys(ids)}
        miss = [i for i, r in have.items() if r is None]
        if miss:
            cap = max(self.ROW_CACHE_TOKENS, self.ROW_CACHE_BYTES // (self.in_features * dtype.itemsize))
            if len(rows) + len(miss) > cap:
                rows.clear()
            for i, r in zip(miss, self.parts[0].lookup(torch.tensor(miss, dtype=torch.long), dtype)):
                have[i] = rows[i, dtype] = r
        # a fresh tensor: the families add into the embeddings in place
        return torch.stack([have[i] for i in ids]).view(*tokens.shape, self.in_features)


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


def _roles(cls, spec: WeightFormat) -> dict[str, tuple[str, bool]]:
    """attribute name -> (packing, keep a dense prefill copy); names left native are absent"""
    roles = {n: (spec.layers, True) for n in cls.packable_weights}
    roles.update({n: (spec.head, False) for n in cls.head_weights})
    roles.update({n: (spec.embedding, False) for n in cls.embedding_weights})
    return {n: r for n, r in roles.items() if r[0] is not None}


def apply_format(model: nn.Module, fmt: str, source: nn.Module | None = None, progress: bool = False) -> nn.Module:
    """Replace the family's declared weights of ``model`` by packed ones, in place. ``source``: the
    same family built in float32 from the same checkpoint, to quantize from (default: ``model``
    itself)."""
    cls = type(model)
    check_format(fmt, cls)
    spec = FORMATS[fmt]
    if spec.layers is None:
        return model
    roles = _roles(cls, spec)
    source = model if source is None else source
    packed: dict[tuple[int, str, bool], PackedWeight] = {}
    pairs = list(zip(list(model.modules()), list(source.modules()), strict=True))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        todo = sum(1 for m, _ in pairs for n in m._parameters if n in roles and m._parameters[n] is not None)
        bar = tqdm(total=todo, desc=f"Packing weights ({fmt})", unit="matrix", leave=False, file=sys.stderr)
    for module, src in pairs:
        for name in [n for n in list(module._parameters) if n in roles]:
            if module._parameters[name] is None:
                continue
            p = src._parameters[name]
            kind, dense = roles[name]
            key = (id(p), kind, dense)
            if key not in packed:
                packed[key] = pack(p.data.float(), kind, dense=dense)
            if name in cls.head_weights and not isinstance(packed[key], RescoredHead):
                packed[key] = RescoredHead(packed[key], p.data.float())
            del module._parameters[name]
            setattr(module, name, packed[key])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return model


def check_format(fmt: str, cls=None) -> None:
    """ValueError (one line, for the user) when ``fmt`` is unknown or family ``cls`` cannot hold it."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if cls is not None and FORMATS[fmt].layers is not None and not cls.packable_weights:
        raise ValueError(f"weight format {fmt!r} is not available for the {cls.family} family "
                         f"(it supports --weights native only)")


def load_model(cls, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
               weights: str = "native", progress: bool = False, quantized: dict | None = None):
    """Build family ``cls`` from a checkpoint: compute ``dtype``, weight format ``weights``.
    Packed weights are quantized from a float32 build (free when the tensors are float32:
    parameters then share their storage), so a bfloat16 compute dtype does not round them first.
    ``quantized``: ``Checkpoint.quantized`` (GGUF raw blocks), needed by the ``gguf`` format and
    ignored by the others (each of its tensors is then dequantized)."""
    check_format(weights, cls)
    if weights == GGUF_FORMAT:
        if not quantized:
            raise ValueError("weight format 'gguf' runs a GGUF file's own quantized blocks, and this "
                             "checkpoint has none (an HF folder, or a GGUF stored in float): use --weights native")
        return load_gguf_model(cls, config, tensors, quantized, dtype)
    if quantized:
        tensors = {**tensors, **{n: q.dequantize() for n, q in quantized.items()}}
    model = cls.from_checkpoint(config, tensors, dtype)
    if FORMATS[weights].layers is None:
        return model
    source = model if dtype == torch.float32 else cls.from_checkpoint(config, tensors, torch.float32)
    return apply_format(model, weights, source, progress=progress)


# --- the gguf format: build around placeholders, then wrap the GGUF blocks ----------------------

_COPY_OPS = {"to", "contiguous", "float", "bfloat16", "half", "detach", "clone", "requires_grad_"}
_CAT_OPS = {"cat", "concat", "concatenate"}


class _Untraceable(Exception):
    def __init__(self, names: list[str], why: str):
        super().__init__(f"{', '.join(names)}: {why}")
        self.names = names


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FusionTracer(torch.overrides.TorchFunctionMode):
    """Follows meta placeholders of quantized checkpoint tensors through a family's constructor.
    ``sources[storage key]`` is the ordered list of parts a meta tensor is made of: checkpoint
    names (quantized) or float tensors (a fused weight with a float-stored part). Only row
    concatenation (``torch.cat`` along dim 0) and dtype/contiguity copies are followed; any other
    op on a placeholder raises ``_Untraceable`` (the builder then dequantizes those tensors).
    ``nn.Parameter`` aliases its tensor's storage, so a parameter is found by its storage."""

    def __init__(self, placeholders: dict[str, torch.Tensor]):
        super().__init__()
        self.sources: dict[int, list] = {}
        self.alive: list[torch.Tensor] = []   # meta tensors kept alive: storage keys stay unique
        for name, t in placeholders.items():
            self._record(t, [name])

    def _record(self, t: torch.Tensor, parts: list) -> None:
        self.sources[_storage_key(t)] = parts
        self.alive.append(t)

    def parts_of(self, t: torch.Tensor) -> list | None:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        return self.sources.get(_storage_key(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tracked = [t for t in leaves if self.parts_of(t) is not None]
        if not tracked:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        names = [n for t in tracked for n in self.parts_of(t) if isinstance(n, str)]
        if name in _CAT_OPS:
            seq = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if any(not isinstance(t, torch.Tensor) or t.dim() != 2 for t in seq) or dim not in (0, -2):
                raise _Untraceable(names, f"{name} other than 2-D rows")
            parts = []
            for t in seq:
                own = self.parts_of(t)
                parts += own if own is not None else [t]
            dtype = seq[0].dtype
            for t in seq[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
            out = torch.empty(sum(t.shape[0] for t in seq), seq[0].shape[1], dtype=dtype, device="meta")
            self._record(out, parts)
            return out
        try:
            out = func(*args, **kwargs)
        except Exception as e:   # noqa: BLE001 - e.g. .to(device) of a meta tensor
            raise _Untraceable(names, f"{name} failed on a placeholder ({e})") from None
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return out           # metadata: .shape, .dtype, .dim() ...
        if name in _COPY_OPS and len(tracked) == 1 and len(outs) == 1 and outs[0].is_meta \
                and outs[0].shape == tracked[0].shape:
            if self.parts_of(outs[0]) is None:
                self._record(outs[0], self.parts_of(tracked[0]))
            return out
        raise _Untraceable(names, f"the family applies {name} to it")


def _build_with_placeholders(cls, config: dict, tensors: dict, quantized: dict, dtype: torch.dtype):
    """Build the family with meta placeholders for the quantized tensors. A tensor the family
    uses in a way that cannot stay quantized (anything but cat-rows / dtype copies) is dequantized
    and the build retried. Returns (model, tracer, names dequantized)."""
    floated: dict[str, torch.Tensor] = {}
    while True:
        keep = {n: q for n, q in quantized.items() if n not in floated}
        placeholders = {n: torch.empty(tuple(q.shape), dtype=torch.float32, device="meta") for n, q in keep.items()}
        tracer = _FusionTracer(placeholders)
        try:
            with tracer:
                model = cls.from_checkpoint(config, {**tensors, **floated, **placeholders}, dtype)
            return model, tracer, sorted(floated)
        except _Untraceable as e:
            new = [n for n in e.names if n not in floated]
            if not new:
                raise
            log.info("gguf weights: %s; dequantized", e)
            for n in new:
                floated[n] = quantized[n].dequantize()


def _materialize(parts: list, quantized: dict, dtype: torch.dtype) -> torch.Tensor:
    rows = [quantized[p].dequantize() if isinstance(p, str) else p.float() for p in parts]
    return (torch.cat(rows) if len(rows) > 1 else rows[0]).to(dtype).contiguous()


def _gguf_parts(names: list[str], quantized: dict) -> list:
    """The GGUFWeights of ``names`` concatenated (GGUFWeight.cat) where neighbours share a
    quantization type: one kernel per run of equal types."""
    from ..kernels import GGUFWeight

    runs: list[list] = []
    for n in names:
        q = quantized[n]
        if runs and runs[-1][0].qtype == q.qtype:
            runs[-1].append(q)
        else:
            runs.append([q])
    return [r[0] if len(r) == 1 else GGUFWeight.cat(r) for r in runs]


def load_gguf_model(cls, config: dict, tensors: dict, quantized: dict, dtype: torch.dtype):
    """The ``gguf`` format (module docstring): the family built around placeholders, each declared
    weight made of quantized parts becomes a ``GGUFPacked``; every other placeholder-built
    tensor is dequantized into the compute dtype. ``model.weight_notes`` lists what did not stay
    one GGUF matmul (also logged)."""
    model, tracer, floated = _build_with_placeholders(cls, config, tensors, quantized, dtype)
    roles = set(cls.packable_weights) | set(cls.head_weights) | set(cls.embedding_weights)
    notes: list[str] = [f"{n}: dequantized (used other than as a matmul weight)" for n in floated]
    done: dict[int, torch.Tensor | PackedWeight] = {}
    split: dict[str, int] = {}
    for mname, module in model.named_modules():
        for name in list(module._parameters) + list(module._buffers):
            t = module._parameters.get(name, module._buffers.get(name))
            parts = tracer.parts_of(t) if t is not None else None
            if parts is None:
                continue
            key = id(t)
            if key not in done:
                quant = all(isinstance(p, str) for p in parts)
                if name in roles and quant:
                    done[key] = GGUFPacked(_gguf_parts(parts, quantized))
                    qt = "+".join(done[key].qtypes)
                    if len(done[key].parts) > 1:
                        split[qt] = split.get(qt, 0) + 1
                else:
                    if name in roles:
                        notes.append(f"{mname}.{name}: float-stored and quantized parts mixed; native")
                    elif any(isinstance(p, str) for p in parts):
                        notes.append(f"{mname}.{name}: not a declared matmul weight; dequantized")
                    done[key] = _materialize(parts, quantized, t.dtype)
            value = done[key]
            is_param = name in module._parameters
            if is_param:
                del module._parameters[name]
            else:
                del module._buffers[name]
            if isinstance(value, PackedWeight):
                if name in cls.head_weights:
                    value.float_out = True
                setattr(module, name, value)
            elif is_param:
                setattr(module, name, nn.Parameter(value, requires_grad=False))
            else:
                module.register_buffer(name, value, persistent=False)
    # a tensor kept on an attribute but not registered (or anything missed) must not stay meta
    leftovers = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftovers:
        raise ValueError(f"gguf weights: could not place {', '.join(leftovers[:5])}")
    for qt, n in sorted(split.items()):
        notes.append(f"{n} fused weight(s) with parts {qt}: one GGUF kernel per part")
    if dtype == torch.float32:
        fused = model.enable_fused()
        if fused:
            notes.append(f"{fused} block(s) run as fused native calls (models/fused.py)")
    for note in notes:
        log.info("gguf weights: %s", note)
    model.weight_notes = notes
    return model


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every weight a model holds, shared tensors once: parameters, buffers and GGUF
    blocks (a decode step reads all of them once: the bundled models' heads are tied tables)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, GGUFPacked) and id(m) not in seen:
            seen.add(id(m))
            total += m.nbytes
    return total


def native_kernels_built() -> bool:
    """True when turnkv.kernels imports and its native extension is compiled (not the pure
    PyTorch fallback)."""
    try:
        from .. import kernels
    except Exception:   # noqa: BLE001 - not built / failed to build: no gguf default
        return False
    built = getattr(kernels, "native_available", None)
    if callable(built):
        try:
            return bool(built())
        except Exception:   # noqa: BLE001
            return False
    return True


def default_format(source_kind: str, cls) -> str:
    """The weight format when none is asked for: ``gguf`` for a GGUF model of a family that
    declares packable weights, when the native kernels are built; ``native`` otherwise (HF
    folders, other families, no compiler at install)."""
    if source_kind == "gguf" and cls.packable_weights and native_kernels_built():
        return GGUF_FORMAT
    return "native"
