"""A family's weights from the checkpoint's tensors: ``take`` (a float tensor), ``stored`` (as the
loader handed it over) and ``fused_weight`` (a matmul weight, fused from parts or not: the GGUF's
own blocks under the ``gguf`` format, else a float Parameter)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import GGUFStack, GGUFWeight
from .gguf_weights import GGUFPacked

log = logging.getLogger("turnkv.weights")

Stored = torch.Tensor | GGUFWeight | GGUFStack     # a checkpoint tensor as the loader handed it over


def stored(tensors: dict[str, Stored], name: str) -> Stored:
    """A checkpoint tensor as stored: under the ``gguf`` format a quantized 2-D tensor is its
    ``GGUFWeight`` (only ``fused_weight`` takes those) and a quantized expert stack its
    ``GGUFStack`` (``stack[e]``: expert e's GGUFWeight); everything else is a float tensor."""
    try:
        return tensors[name]
    except KeyError:
        raise MissingWeight(f"checkpoint has no tensor {name!r}") from None


def as_float(t: Stored) -> torch.Tensor:
    """The float value of a stored tensor (a GGUF one dequantized, bit-exact)."""
    return t.dequantize() if isinstance(t, (GGUFWeight, GGUFStack)) else t


def fused_weight(parts: list[Stored], dtype: torch.dtype) -> nn.Parameter | GGUFPacked:
    """A matmul weight made of ``parts`` stacked along the output rows (q/k/v, gate/up, or one
    part): the GGUF's own blocks (``GGUFPacked``; ``GGUFWeight.cat`` of neighbours of one
    quantization type) when every part is stored quantized, else a Parameter of the float rows in
    ``dtype``. Only the family knows which of its weights are fused from which tensors, so it says
    so here, in its own order. Assign it to a name the family declares (``Model.packable_weights``
    and friends): the other formats pack those names from the float build."""
    if parts and all(isinstance(p, GGUFWeight) for p in parts):
        packed = GGUFPacked(_gguf_runs(parts))
        packed.source_ids = {id(p) for p in parts}
        return packed
    if any(isinstance(p, GGUFWeight) for p in parts):
        log.info("gguf weights: a fused weight mixes float-stored and quantized parts; native")
    rows = [as_float(p) for p in parts]
    return param(torch.cat(rows) if len(rows) > 1 else rows[0], dtype)


def take(tensors: dict[str, Stored], name: str) -> torch.Tensor:
    """A checkpoint tensor as a float tensor (a GGUF-quantized one dequantized)."""
    return as_float(stored(tensors, name))


def weight(part: Stored, dtype: torch.dtype) -> nn.Parameter | GGUFPacked:
    """``fused_weight`` of one part."""
    return fused_weight([part], dtype)


def param(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype).contiguous(), requires_grad=False)


class MissingWeight(KeyError):
    pass


def _gguf_runs(parts: list[GGUFWeight]) -> list[GGUFWeight]:
    """``parts`` concatenated (GGUFWeight.cat) where neighbours share a quantization type: one
    kernel per run of equal types."""
    runs: list[list[GGUFWeight]] = []
    for q in parts:
        if runs and runs[-1][0].qtype == q.qtype:
            runs[-1].append(q)
        else:
            runs.append([q])
    return [r[0] if len(r) == 1 else GGUFWeight.cat(r) for r in runs]
