"""Qwen3.5-VL (``clip.projector_type`` qwen3vl_merger): the ViT (fused qkv, learned positions
interpolated over a square table, 2-D rotary), its patch merger (``v.post_ln``, ``mm.0``,
``mm.2``) and a qwen35 / qwen35moe text GGUF (models/qwen3_5_vl.py).

The converter splits the Conv3d patch embedding along time into ``v.patch_embd.weight`` and
``.weight.1`` (it only takes a temporal patch of 2); they are stacked back. The text GGUF's
``rope.dimension_sections`` are M-RoPE's t / h / w sections (interleaved, as Qwen3.5 rotates).
The preprocessing is llama.cpp's for this projector: smart resize between 8 and 4096 merged tokens
an image (``clip.vision.image_min_pixels`` / ``image_max_pixels`` when the file has them), bicubic
(the processor's default), the file's mean and std. Deepstack layers (Qwen3-VL) are refused.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..reader import GGUFHeader
from .layout import MmprojLayout, clip_value, mean_std, token_id

VISUAL = "model.visual"
PATCH = f"{VISUAL}.patch_embed.proj.weight"
_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}


def _vision_config(h: GGUFHeader) -> dict:
    if any(clip_value(h, "is_deepstack_layers", [])):
        raise ModelLoadError(f"{h.path}: a vision tower with deepstack layers (Qwen3-VL) is not supported")
    if not h.get("clip.use_gelu", False):
        raise ModelLoadError(f"{h.path}: only GELU vision towers are supported (clip.use_gelu is not set)")
    return {
        "depth": clip_value(h, "block_count"),
        "hidden_size": clip_value(h, "embedding_length"),
        "intermediate_size": clip_value(h, "feed_forward_length"),
        "num_heads": clip_value(h, "attention.head_count"),
        "out_hidden_size": clip_value(h, "projection_dim"),
        "patch_size": clip_value(h, "patch_size"),
        "spatial_merge_size": clip_value(h, "spatial_merge_size", 2),
        "temporal_patch_size": 2,
        "num_position_embeddings": h.tensors["v.position_embd.weight"].shape[0],
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
    }


def build_config(h: GGUFHeader, text: GGUFHeader, text_config: dict) -> dict:
    sections = text.metadata.get(f"{text.architecture}.rope.dimension_sections")
    if sections is None:
        raise ModelLoadError(f"{text.path}: no '{text.architecture}.rope.dimension_sections' (M-RoPE), "
                             f"which the vision projector {h.path.name} needs")
    text_config = dict(text_config)
    text_config["rope_parameters"] = {**text_config["rope_parameters"], "mrope_section": list(sections)[:3],
                                      "mrope_interleaved": True}
    moe = text_config["model_type"] == "qwen3_5_moe_text"
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": _vision_config(h),
        "image_token_id": token_id(text, "<|image_pad|>", h),
        "vision_start_token_id": token_id(text, "<|vision_start|>", h),
        "vision_end_token_id": token_id(text, "<|vision_end|>", h),
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
    }


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = {"v.patch_embd.weight": f"{PATCH}.0", "v.patch_embd.weight.1": f"{PATCH}.1",
             "v.patch_embd.bias": f"{VISUAL}.patch_embed.proj.bias",
             "v.position_embd.weight": f"{VISUAL}.pos_embed.weight"}
    for i in range(config["vision_config"]["depth"]):
        for g, t in _BLOCK.items():
            for kind in ("weight", "bias"):
                names[f"v.blk.{i}.{g}.{kind}"] = f"{VISUAL}.blocks.{i}.{t}.{kind}"
    for g, t in (("v.post_ln", "norm"), ("mm.0", "linear_fc1"), ("mm.2", "linear_fc2")):
        for kind in ("weight", "bias"):
            names[f"{g}.{kind}"] = f"{VISUAL}.merger.{t}.{kind}"
    return names


def finish(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Conv3d patch embedding back from its two temporal halves."""
    tensors[PATCH] = torch.stack([tensors.pop(f"{PATCH}.0"), tensors.pop(f"{PATCH}.1")], dim=2)
    return tensors


def text_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]


def image_settings(h: GGUFHeader, config: dict) -> dict:
    v = config["vision_config"]
    area = (v["patch_size"] * v["spatial_merge_size"]) ** 2
    return {"patch_size": v["patch_size"], "temporal_patch_size": 2, "merge_size": v["spatial_merge_size"],
            "min_pixels": clip_value(h, "image_min_pixels", 8 * area),
            "max_pixels": clip_value(h, "image_max_pixels", 4096 * area), "resample": 3, **mean_std(h)}


LAYOUTS = {"qwen3vl_merger": MmprojLayout("Qwen3.5-VL", "qwen3_5", ("qwen3_5_text", "qwen3_5_moe_text"),
                                          build_config, tensor_names, text_name, image_settings, finish=finish)}
