"""SmolVLM / Idefics3 (``clip.projector_type`` idefics3): a SigLIP tower, the pixel-shuffle
connector's one matrix (``mm.model.fc``) and a llama text GGUF (models/idefics3.py).

The preprocessing is llama.cpp's for this projector: images resized to the longest edge
``clip.vision.preproc_image_size`` and always split into ``image_size`` tiles plus the global one
(transformers' ``do_image_splitting``), Lanczos resampling (the processor's default), the file's
mean and std. A folder saved with splitting off converts to the same mmproj: the file cannot say it.
"""

from __future__ import annotations

from ..reader import GGUFHeader
from .layout import MmprojLayout, clip_value, mean_std, siglip_config, siglip_names, token_id

VISION = "model.vision_model"


def build_config(h: GGUFHeader, text: GGUFHeader, text_config: dict) -> dict:
    return {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": siglip_config(h),
        "scale_factor": clip_value(h, "projector.scale_factor", 2),
        "image_token_id": token_id(text, "<image>", h),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
    }


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = siglip_names(config["vision_config"]["num_hidden_layers"], VISION)
    names["mm.model.fc.weight"] = "model.connector.modality_projection.proj.weight"
    return names


def text_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model.text_model." + name[len("model."):]


def image_settings(h: GGUFHeader, config: dict) -> dict:
    tile = config["vision_config"]["image_size"]
    return {"do_image_splitting": True, "size": {"longest_edge": clip_value(h, "preproc_image_size", 4 * tile)},
            "max_image_size": {"longest_edge": tile}, **mean_std(h)}


LAYOUTS = {"idefics3": MmprojLayout("SmolVLM / Idefics3", "idefics3", ("llama",), build_config, tensor_names,
                                    text_name, image_settings)}
