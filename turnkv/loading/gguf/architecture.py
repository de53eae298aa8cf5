"""How a GGUF `general.architecture` maps onto a transformers model type (``GGUFArchitecture``),
and the tensor names llama.cpp's converters share across families."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .reader import GGUFHeader


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF `general.architecture` maps onto a transformers model type."""

    model_type: str
    build_config: Callable[[GGUFHeader], dict]
    # blk.{i}.<gguf name> -> model.layers.{i}.<transformers name> (".weight" required, ".bias" optional)
    layer_tensors: dict[str, str]
    # (transformers name, float32 tensor, config) -> tensor; None when nothing to undo
    transform: Callable[[str, torch.Tensor, dict], torch.Tensor] | None = None
    needs_transform: Callable[[str], bool] = field(default=lambda name: False)
    # True when ``transform`` only reorders whole rows of a 2-D tensor (llama's q/k un-permute):
    # it may then run on a quantized tensor's raw block rows (blocks run along a row), which
    # keeps the tensor quantized. Otherwise a transformed tensor is always dequantized.
    transform_permutes_rows: bool = False
    # Families whose layers differ (hybrids, MoE, shared-KV layers) name their tensors themselves:
    # (header, config) -> {gguf name: transformers name} for every tensor they need (missing ones
    # are reported by ``tensor_name_map``), replacing the layer_tensors / global-tensor walk.
    tensor_names: Callable[[GGUFHeader, dict], dict[str, str]] | None = None
    # After every tensor is read and transformed: (transformers-named tensors, config) -> the
    # tensors the family's from_checkpoint takes (split stacked experts, fuse, reshape, drop).
    # 2-D tensors kept quantized (the ``gguf`` weight format) are not in this dict; kept 3-D expert
    # stacks are, as ``turnkv.kernels.GGUFStack`` (``common.fuse_gate_up`` and indexing take
    # them; what is left of them afterwards joins the kept tensors). It may also set
    # config keys that say how the tensors it leaves are laid out (Qwen 3.5's
    # ``linear_value_heads_tiled`` when quantized delta-net projections keep the file's head order).
    finish: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]] | None = None


# Per-layer tensor names llama.cpp's converters share across families (blk.{i}.<gguf> ->
# model.layers.{i}.<transformers>), for building each family's layer table.
ATTN_PROJ_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GATED_MLP_TENSORS = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# Outside the layers: gguf name -> transformers name (".weight" appended to both)
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
