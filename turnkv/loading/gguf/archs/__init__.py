"""GGUF layouts, one module per family: GGUF ``general.architecture`` -> ``GGUFArchitecture``.

Each module reads llama.cpp's layout for its family (the names, metadata keys and tensor
transforms `convert_hf_to_gguf.py` writes) and exports ``ARCHITECTURES``: the
``GGUFArchitecture`` of each architecture name it reads (a config builder: GGUF metadata -> the
transformers config the family's ``from_checkpoint`` takes, the tensor names and the inverse of the
converter's transforms). tests/test_gguf_families.py checks each against a fixture the real
converter wrote. What several families share lives in ``common.py`` (and ``kda_mla.py`` for the
two KDA/MLA hybrids), never in another family's module (llama's q/k un-permute aside).
"""

from __future__ import annotations

from ..architecture import GGUFArchitecture
from . import (afmoe, bailing_hybrid, exaone4, gemma3, gemma4, glm4_moe, gpt_oss, kimi_linear, lfm2, llama,
               ministral, muse_glimmer, qwen, qwen3_5, rwkv7)

FAMILIES = (llama, qwen, gemma3, afmoe, kimi_linear, muse_glimmer, bailing_hybrid, exaone4, ministral, gpt_oss, glm4_moe,
            qwen3_5, gemma4, lfm2, rwkv7)

SUPPORTED_GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    name: arch for family in FAMILIES for name, arch in family.ARCHITECTURES.items()}

