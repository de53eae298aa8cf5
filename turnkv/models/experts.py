"""The routed experts of a MoE layer, one path for every family: the family routes (weights and
chosen experts per token), ``RoutedExperts`` runs the chosen experts and sums their outputs.

Experts come from stacks [E, out, in] as the checkpoint holds them. Under the ``gguf`` weight
format a GGUF's stack is a ``turnkv.kernels.GGUFStack``: expert e's weight is a view of the loaded
blocks (no copy), run by the GGUF kernels like any 2-D weight; a float stack gives each expert its
slice. Each expert is a module of its own (``GatedMLP``, or a family's), so the other weight
formats pack experts as they pack any ``wgu`` / ``wdown``.

The combine is batch- and chunk-invariant: tokens are grouped per chosen expert, each expert runs
its group's rows (the kernels compute a row the same whatever the other rows), and a token's
output is the sum of its experts' outputs added in ascending expert id, transformers' order. So a
token's result never depends on which other tokens share the step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .decoder import GatedMLP, gelu_tanh_, silu_
from .tensors import Stored, stored, take


def expert_stacks(t: dict[str, Stored], p: str, n: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
    """([E, 2I, H] gate|up, [E, H, I] down) of the MoE at ``p``, as stored: transformers' fused
    in-memory names (``experts.gate_up_proj``; a GGUF's blocks stay a ``GGUFStack``), else the
    per-expert names save_pretrained and the Hub files use (``names``: gate, up, down), stacked."""
    if f"{p}.experts.gate_up_proj" in t:
        return stored(t, f"{p}.experts.gate_up_proj"), stored(t, f"{p}.experts.down_proj")
    g, u, d = names
    gu = torch.stack([torch.cat([take(t, f"{p}.experts.{e}.{g}.weight"), take(t, f"{p}.experts.{e}.{u}.weight")])
                      for e in range(n)])
    down = torch.stack([take(t, f"{p}.experts.{e}.{d}.weight") for e in range(n)])
    return gu, down


class RoutedExperts(nn.ModuleList):
    """One module per expert (``experts[e].forward(x)``), and their weighted sum per token. After
    ``fuse``, a call runs as one native call that does the same operations (csrc/moe_experts.inc:
    row by row for a decode step's few rows, grouped per expert for a prefill chunk): the same
    bits."""

    native = None       # the kernels' MoEExperts, once ``fuse`` made it
    isa = 0

    @classmethod
    def gated(cls, gate_up, down, dtype: torch.dtype, act=silu_) -> "RoutedExperts":
        """``GatedMLP`` experts from stacks (``expert_stacks``): expert e's fused gate|up weight is
        ``gate_up[e]``, its down weight ``down[e]``."""
        return cls(GatedMLP([gate_up[e]], down[e], dtype, act) for e in range(len(gate_up)))

    def fuse(self) -> bool:
        """Let calls run as one native call, when every expert is a bias-free, unclipped ``GatedMLP``
        on GGUF blocks (int8 kernels) with one activation and the build has the call
        (``TURNKV_FUSED_MOE=0`` keeps the grouped path: A/B, tests)."""
        from .. import kernels
        from .fused import _qlinear, fused_available

        acts = {silu_: 0, gelu_tanh_: 1}
        if (not fused_available() or not hasattr(kernels._ext, "moe_experts")
                or os.environ.get("TURNKV_FUSED_MOE", "1").strip() == "0"):
            return False
        if not all(isinstance(m, GatedMLP) and m.bgu is None and m.bdown is None and m.limit is None
                   and m.act is self[0].act for m in self) or self[0].act not in acts:
            return False
        gu, down = [_qlinear(m.wgu) for m in self], [_qlinear(m.wdown) for m in self]
        if None in gu or None in down:
            return False
        self.native, self.isa = kernels._ext.MoEExperts(gu, down, acts[self[0].act]), kernels._isa_index(None)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                out: torch.Tensor | None = None, scale_input: bool = False) -> torch.Tensor:
        """``out`` (zeros by default) plus, for every row of ``x``, ``weights[row, slot] *
        experts[chosen[row, slot]](x[row])`` over its slots, added in ascending expert id. The
        product is taken in the promoted dtype of the expert output and ``weights``, then cast to
        ``out``'s. ``scale_input``: the weight scales the expert's input instead (Llama 4)."""
        out = torch.zeros_like(x) if out is None else out
        if (self.native is not None and not scale_input
                and x.dtype == weights.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous()):
            from .. import kernels

            kernels._ext.moe_experts(self.native, x, chosen.contiguous(), weights.contiguous(), out, self.isa)
            return out
        k = chosen.shape[1]
        # every (row, slot) grouped by expert, rows ascending within a group: one sort, not a
        # search per expert
        order = torch.sort(chosen.reshape(-1), stable=True)
        counts = torch.bincount(order.values, minlength=len(self)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            at = order.indices[start:start + n]
            start += n
            rows, w = at // k, weights.reshape(-1)[at, None]
            y = self[e].forward(x[rows] * w) if scale_input else self[e].forward(x[rows]) * w
            out.index_add_(0, rows, y.to(out.dtype))
        return out
