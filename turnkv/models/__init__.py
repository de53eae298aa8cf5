"""Model families. ``ARCHITECTURES`` maps an HF ``model_type`` to the family class that runs it."""

from __future__ import annotations

import importlib

# model_type -> "module:Class" (explicit registry; a family is one module)
ARCHITECTURES: dict[str, str] = {
    "llama": "llama:LlamaModel",
    "qwen2": "llama:LlamaModel",                   # Qwen 2 / 2.5: q/k/v biases
    "qwen3": "llama:LlamaModel",                   # Qwen 3 dense: q/k RMS norms
    "qwen3_moe": "qwen3_moe:Qwen3MoeModel",
    "gemma3_text": "gemma3:Gemma3Model",
    "gemma3": "gemma3_vision:Gemma3VisionModel",   # Gemma3ForConditionalGeneration (vision + text)
    "llama4_text": "llama4:Llama4Model",
    "lfm2": "lfm2:Lfm2Model",
    "granitemoehybrid": "granitemoehybrid:GraniteMoeHybridModel",
    "mamba2": "mamba2:Mamba2Model",
    "qwen3_next": "qwen3_next:Qwen3NextModel",
    "qwen3_5_text": "qwen3_5:Qwen3_5Model",
    "qwen3_5_moe_text": "qwen3_5:Qwen3_5Model",
    "qwen3_5": "qwen3_5_vl:Qwen3_5VlModel",     # the released vision-language folders (text-only without a tower)
    "qwen3_5_moe": "qwen3_5_vl:Qwen3_5VlModel",
    "glm4_moe": "glm4_moe:Glm4MoeModel",
    "afmoe": "afmoe:AfmoeModel",
    "recurrent_gemma": "recurrent_gemma:RecurrentGemmaModel",
    "exaone4": "exaone4:Exaone4Model",
    "ministral": "ministral:MinistralModel",
    "ministral3": "ministral:MinistralModel",
    "gpt_oss": "gpt_oss:GptOssModel",
    "gemma4_text": "gemma4:Gemma4Model",
    "gemma4": "gemma4:Gemma4Model",                # the released folders: text decoder only
    "kimi_linear": "kimi_linear:KimiLinearModel",
    "bailing_hybrid": "bailing_hybrid:BailingHybridModel",
    "muse_glimmer": "muse_glimmer:MuseGlimmerModel",   # MuseGlimmerForConditionalGeneration: text decoder only
    "idefics3": "idefics3:Idefics3Model",
    "smolvlm": "idefics3:Idefics3Model",
    "lfm2_vl": "lfm2_vl:Lfm2VlModel",
    "rwkv7": "rwkv7:Rwkv7Model",                   # RWKV7ForCausalLM, the fla-hub layout
}


def family_class(model_type: str):
    try:
        target = ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
