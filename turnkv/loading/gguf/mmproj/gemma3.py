"""Gemma 3 (``clip.projector_type`` gemma3): a SigLIP tower, the projector's RMSNorm
(``mm.soft_emb_norm``, stored by the converter with Gemma's "+1") and projection
(``mm.input_projection``, which the converter always writes in F16), and a gemma3 text GGUF
(models/gemma3_vision.py).

The image tokens per image are the tower's patch grid pooled by ``clip.vision.projector.scale_factor``
per side (4 when the file names none, llama.cpp's default); the preprocessing is one resize to
``image_size`` square, bilinear (llama.cpp's and the processor's default), the file's mean and std.
"""

from __future__ import annotations

import torch

from ..reader import GGUFHeader
from .layout import MmprojLayout, clip_value, mean_std, siglip_config, siglip_names, token_id

PROJECTOR = "model.multi_modal_projector"
NORM = f"{PROJECTOR}.mm_soft_emb_norm.weight"


def build_config(h: GGUFHeader, text: GGUFHeader, text_config: dict) -> dict:
    vision = siglip_config(h)
    side = vision["image_size"] // vision["patch_size"] // clip_value(h, "projector.scale_factor", 4)
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": vision,
        "mm_tokens_per_image": side * side,
        "image_token_index": token_id(text, "<image_soft_token>", h),
        "boi_token_index": token_id(text, "<start_of_image>", h),
        "eoi_token_index": token_id(text, "<end_of_image>", h),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
    }


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = siglip_names(config["vision_config"]["num_hidden_layers"], "model.vision_tower.vision_model")
    names["mm.input_projection.weight"] = f"{PROJECTOR}.mm_input_projection_weight"
    names["mm.soft_emb_norm.weight"] = NORM
    return names


def text_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]


def transform(name: str, w: torch.Tensor) -> torch.Tensor:
    """The converter stores the projector's norm as 1 + w; (1 + w) - 1 is exact in float32 for the
    norm's range, and the model adds the 1 back as transformers does."""
    return w - 1.0 if name == NORM else w


def image_settings(h: GGUFHeader, config: dict) -> dict:
    side = config["vision_config"]["image_size"]
    return {"size": {"height": side, "width": side}, "resample": 2, "do_pan_and_scan": False, **mean_std(h)}


LAYOUTS = {"gemma3": MmprojLayout("Gemma 3", "gemma3", ("gemma3_text",), build_config, tensor_names, text_name,
                                  image_settings, transform)}
