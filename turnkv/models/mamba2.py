"""Mamba 2: every layer is an SSD mixer (conv state + SSM state), no attention at all.
The mixer lives in ssm.py because hybrid families (Granite 4 / granitemoehybrid) share it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from .base import BaseArgs, Model, linear, rms_norm
from .ssm import Mamba2Dims, Mamba2Mixer, mamba2_state_fields, time_step_limit
from .tensors import param, take


@dataclass
class ModelArgs(BaseArgs):
    computes = {"hidden_act": ("silu",)}
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_heads: int
    head_dim: int
    state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    time_step_limit: list | tuple | None = None

    def dims(self) -> Mamba2Dims:
        return Mamba2Dims(self.hidden_size, self.num_heads, self.head_dim, self.state_size, self.n_groups,
                          self.conv_kernel, self.chunk_size, self.layer_norm_epsilon, self.use_bias,
                          self.use_conv_bias, time_step_limit(self.time_step_limit))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"backbone.layers.{i}"
        self.eps, self.dtype = a.layer_norm_epsilon, dtype
        self.residual_in_fp32 = a.residual_in_fp32
        self.ln = param(take(t, f"{p}.norm.weight"), dtype)
        self.mixer = Mamba2Mixer(a.dims(), t, f"{p}.mixer", dtype)

    def forward(self, x, batch, i):
        h = self.mixer.forward(rms_norm(x.to(self.dtype), self.ln, self.eps), batch, i)
        # transformers keeps the residual stream in float32 when residual_in_fp32 (the default)
        return (x.float() if self.residual_in_fp32 else x) + h


class Mamba2Model(Model):
    family = "mamba2"

    def __init__(self, args: ModelArgs, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.args, self.dtype = args, dtype
        # early conversions named it backbone.embedding (transformers renames it in a load hook)
        name = "backbone.embedding.weight" if "backbone.embedding.weight" in tensors else "backbone.embeddings.weight"
        self.embed = param(take(tensors, name), dtype)
        self.layers = nn.ModuleList(Block(args, tensors, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = param(take(tensors, "backbone.norm_f.weight"), dtype)
        head = tensors.get("lm_head.weight")
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else param(head, dtype)

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(ModelArgs.from_dict(config), tensors, dtype)

    def cache_specs(self):
        fields = mamba2_state_fields(self.args.dims())
        return [specs.recurrent(**fields) for _ in range(self.args.num_hidden_layers)]

    def forward(self, batch):
        x = F.embedding(batch.tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i)
        return self.final_logits(x, batch)

    def head(self, x):
        return linear(rms_norm(x.to(self.dtype), self.norm, self.args.layer_norm_epsilon), self.lm_head)
