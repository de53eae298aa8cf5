"""What one llama.cpp projector type (``clip.projector_type``) declares, and the SigLIP tower's
names and config keys that several of them share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import ModelLoadError
from ..reader import GGUFArray, GGUFHeader


@dataclass(frozen=True)
class MmprojLayout:
    """How an mmproj of one projector type joins a text GGUF into a vision family's checkpoint."""

    family: str                        # the vision family, for messages
    model_type: str                    # the joined checkpoint's model_type (its family; build_config may refine it)
    text_types: tuple[str, ...]        # the text GGUF's model types this projector pairs with
    # (mmproj header, text header, text config) -> the joined config.json-style dict
    build_config: Callable[[GGUFHeader, GGUFHeader, dict], dict]
    # (mmproj header, joined config) -> {gguf name: transformers name} of every vision tensor
    tensor_names: Callable[[GGUFHeader, dict], dict[str, str]]
    # a text tensor's transformers name -> its name in the joined checkpoint
    text_name: Callable[[str], str]
    # (mmproj header, joined config) -> the image processor settings (transformers' keys)
    image_settings: Callable[[GGUFHeader, dict], dict]
    # (transformers name, float32 tensor) -> the tensor before the converter's changes
    transform: Callable[[str, torch.Tensor], torch.Tensor] = field(default=lambda name, w: w)
    # after every tensor is read: the vision tensors -> those the family takes (a split put back)
    finish: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = field(default=lambda tensors: tensors)


def clip_value(h: GGUFHeader, key: str, default=...):
    value = h.get(f"clip.vision.{key}", default)
    return list(value) if isinstance(value, (list, GGUFArray)) else value


def siglip_config(h: GGUFHeader) -> dict:
    """A SigLIP-style tower's vision_config from its ``clip.vision.*`` keys. ``clip.use_gelu`` is
    llama.cpp's tanh GELU (SigLIP's ``gelu_pytorch_tanh``)."""
    if not h.get("clip.use_gelu", False):
        raise ModelLoadError(f"{h.path}: only GELU vision towers are supported (clip.use_gelu is not set)")
    return {
        "hidden_size": clip_value(h, "embedding_length"),
        "intermediate_size": clip_value(h, "feed_forward_length"),
        "num_hidden_layers": clip_value(h, "block_count"),
        "num_attention_heads": clip_value(h, "attention.head_count"),
        "image_size": clip_value(h, "image_size"),
        "patch_size": clip_value(h, "patch_size"),
        "layer_norm_eps": clip_value(h, "attention.layer_norm_epsilon", 1e-6),
        "hidden_act": "gelu_pytorch_tanh",
        "num_channels": 3,
    }


_SIGLIP_LAYER = {
    "ln1": "layer_norm1", "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}


def siglip_names(layers: int, prefix: str) -> dict[str, str]:
    """{gguf name: transformers name} of a SigLIP tower under ``prefix`` (weights and biases)."""
    names = {"v.patch_embd.weight": f"{prefix}.embeddings.patch_embedding.weight",
             "v.patch_embd.bias": f"{prefix}.embeddings.patch_embedding.bias",
             "v.position_embd.weight": f"{prefix}.embeddings.position_embedding.weight",
             "v.post_ln.weight": f"{prefix}.post_layernorm.weight",
             "v.post_ln.bias": f"{prefix}.post_layernorm.bias"}
    for i in range(layers):
        for g, t in _SIGLIP_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"v.blk.{i}.{g}.{kind}"] = f"{prefix}.encoder.layers.{i}.{t}.{kind}"
    return names


def token_id(text: GGUFHeader, token: str, mmproj: GGUFHeader) -> int:
    """The id of ``token`` in the text GGUF's vocabulary (llama.cpp finds image tokens by name)."""
    tokens = text.metadata.get("tokenizer.ggml.tokens")
    try:
        return list(tokens).index(token)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{text.path}: the vocabulary has no '{token}' token, which the vision "
                             f"projector {mmproj.path.name} needs") from None


def mean_std(h: GGUFHeader) -> dict:
    """The normalization as float32 values (the processors cast it to the float32 pixels' type)."""
    return {"image_mean": [float(v) for v in clip_value(h, "image_mean")],
            "image_std": [float(v) for v in clip_value(h, "image_std")]}
