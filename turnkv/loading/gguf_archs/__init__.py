"""GGUF layouts of the families beyond llama and gemma3, one module per family.

Each module reads llama.cpp's layout for its family (the names, metadata keys and tensor
transforms `convert_hf_to_gguf.py` writes) and calls ``turnkv.loading.gguf.register`` with a
``GGUFArchitecture``: a config builder (GGUF metadata -> the transformers config the family's
``from_checkpoint`` takes), the tensor names and the inverse of the converter's transforms.
tests/test_gguf_families.py checks each against a fixture the real converter wrote. What several
families share lives in ``common.py`` (and ``kda_mla.py`` for the two KDA/MLA hybrids), never in
another family's module.
"""

from importlib import import_module

# Modules listed here are imported (and register themselves) the first time a GGUF is opened.
FAMILIES: tuple[str, ...] = ("afmoe", "kimi_linear", "muse_glimmer", "bailing_hybrid", "exaone4", "ministral", "gpt_oss", "glm4_moe", "qwen3_5", "gemma4")

for _name in FAMILIES:
    import_module(f"{__name__}.{_name}")
