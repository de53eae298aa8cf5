"""LFM2-VL (``clip.projector_type`` lfm2): a SigLIP 2 NaFlex tower, the pixel-unshuffle projector
(``mm.input_norm`` LayerNorm, ``mm.1`` / ``mm.2`` with GELU) and an lfm2 text GGUF
(models/lfm2_vl.py, loading/gguf/archs/lfm2.py).

The converter writes the patch embedding (a Linear over 16 x 16 x 3 pixel patches in transformers)
as a Conv2d kernel, ``view(C, 16, 16, 3).permute(0, 3, 1, 2)``; it is put back. It also drops the
tower's layers past ``vision_feature_layer`` (``block_count`` is what runs) and writes an
``image_size`` of 256 that no one reads. The preprocessing is llama.cpp's fixed one for this
projector, which is the processor's defaults: 512 px tiles (2 to 10, plus a thumbnail), 64 to 256
image tokens, bilinear, downsampling by ``projector.scale_factor``, the file's mean and std.
"""

from __future__ import annotations

import torch

from ..reader import GGUFHeader
from .layout import MmprojLayout, clip_value, mean_std, siglip_config, siglip_names, token_id

VISION = "model.vision_tower.vision_model"
PROJECTOR = "model.multi_modal_projector"
PATCH = f"{VISION}.embeddings.patch_embedding.weight"


def build_config(h: GGUFHeader, text: GGUFHeader, text_config: dict) -> dict:
    vision = siglip_config(h)
    del vision["image_size"]
    vision |= {"model_type": "siglip2_vision_model", "num_patches": h.tensors["v.position_embd.weight"].shape[0]}
    return {
        "model_type": "lfm2_vl",
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": vision,
        "downsample_factor": clip_value(h, "projector.scale_factor", 2),
        "projector_hidden_size": h.tensors["mm.1.weight"].shape[0],
        "projector_hidden_act": "gelu",
        "projector_bias": "mm.1.bias" in h.tensors,
        "projector_use_layernorm": "mm.input_norm.weight" in h.tensors,
        "vision_feature_layer": -1,
        "image_token_id": token_id(text, "<image>", h),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
    }


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = siglip_names(config["vision_config"]["num_hidden_layers"], VISION)
    pieces = [("mm.1", "linear_1"), ("mm.2", "linear_2")]
    if config["projector_use_layernorm"]:
        pieces.append(("mm.input_norm", "layer_norm"))
    for g, t in pieces:
        for kind in ("weight", "bias"):
            if kind == "weight" or config["projector_bias"] or g == "mm.input_norm":
                names[f"{g}.{kind}"] = f"{PROJECTOR}.{t}.{kind}"
    return names


def text_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]


def transform(name: str, w: torch.Tensor) -> torch.Tensor:
    """The Conv2d kernel [C, 3, P, P] back to transformers' Linear over (P, P, 3) patches."""
    return w.permute(0, 2, 3, 1).reshape(w.shape[0], -1) if name == PATCH else w


def image_settings(h: GGUFHeader, config: dict) -> dict:
    return {"encoder_patch_size": config["vision_config"]["patch_size"],
            "downsample_factor": config["downsample_factor"], **mean_std(h)}


LAYOUTS = {"lfm2": MmprojLayout("LFM2-VL", "lfm2_vl", ("lfm2",), build_config, tensor_names, text_name,
                                image_settings, transform)}
