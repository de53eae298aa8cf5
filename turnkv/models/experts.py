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

import torch
from torch import nn

from .decoder import GatedMLP, silu_
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
    """One module per expert (``experts[e].forward(x)``), and their weighted sum per token."""

    @classmethod
    def gated(cls, gate_up, down, dtype: torch.dtype, act=silu_) -> "RoutedExperts":
        """``GatedMLP`` experts from stacks (``expert_stacks``): expert e's fused gate|up weight is
        ``gate_up[e]``, its down weight ``down[e]``."""
        return cls(GatedMLP([gate_up[e]], down[e], dtype, act) for e in range(len(gate_up)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                out: torch.Tensor | None = None, scale_input: bool = False) -> torch.Tensor:
        """``out`` (zeros by default) plus, for every row of ``x``, ``weights[row, slot] *
        experts[chosen[row, slot]](x[row])`` over its slots, added in ascending expert id. The
        product is taken in the promoted dtype of the expert output and ``weights``, then cast to
        ``out``'s. ``scale_input``: the weight scales the expert's input instead (Llama 4)."""
        out = torch.zeros_like(x) if out is None else out
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            w = weights[rows, slot, None]
            y = self[e].forward(x[rows] * w) if scale_input else self[e].forward(x[rows]) * w
            out.index_add_(0, rows, y.to(out.dtype))
        return out
