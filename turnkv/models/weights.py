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
is built on them: where it fuses a matmul weight it says so with ``models.tensors.fused_weight``
(q/k/v, gate/up, or one part), which makes the weight ``GGUFWeight.cat`` of those parts in that
order; any other use of a quantized tensor (``take``) dequantizes it. Parts of different quantization types (Gemma 3's Q4_K_M mixes
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

import sys
from dataclasses import dataclass

import torch
from torch import nn

from .gguf_weights import GGUFPacked, load_gguf_model
from .packed import PackedWeight, RescoredHead, pack

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
