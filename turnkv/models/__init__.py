"""Model families. ``ARCHITECTURES`` maps an HF ``model_type`` to the family class that runs it."""

from __future__ import annotations

import importlib

# model_type -> "module:Class" (explicit registry; a family is one module)
ARCHITECTURES: dict[str, str] = {
    "llama": "llama:LlamaModel",
    "gemma3_text": "gemma3:Gemma3Model",
    "gemma3": "gemma3:Gemma3Model",
    "llama4_text": "llama4:Llama4Model",
    "lfm2": "lfm2:Lfm2Model",
    "granitemoehybrid": "granitemoehybrid:GraniteMoeHybridModel",
    "mamba2": "mamba2:Mamba2Model",
    "qwen3_next": "qwen3_next:Qwen3NextModel",
    "recurrent_gemma": "recurrent_gemma:RecurrentGemmaModel",
}


def family_class(model_type: str):
    try:
        target = ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
