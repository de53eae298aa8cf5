"""Model loading: a bundled name, a .gguf file or an HF folder -> Checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..registry import BUNDLED
from .bundled import CHAT_TEMPLATES, locate_bundled
from .errors import ModelLoadError
from .gguf import SUPPORTED_GGUF_ARCHITECTURES, GGUFArchitecture
from .tokenizer import RenderedChat, StreamDecoder, Tokenizer, shipped_template

__all__ = [
    "Checkpoint",
    "GGUFArchitecture",
    "ModelLoadError",
    "RenderedChat",
    "StreamDecoder",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "Tokenizer",
    "load_checkpoint",
    "load_tokenizer",
]

# GGUF architectures whose files carry no chat template get the shipped one
_FALLBACK_TEMPLATES = {"gemma3": "gemma3"}


@dataclass
class Checkpoint:
    architecture: str  # HF model_type: "llama", "gemma3_text", ...
    config: dict  # config.json-style, transformers' key names
    tensors: dict[str, torch.Tensor]  # transformers' parameter names; no lm_head when tied
    tokenizer: Tokenizer | None  # None only when the file/folder holds no tokenizer
    source: Path  # the file or folder loaded
    fingerprint: str  # stable hex id of the weights
    name: str  # bundled name or file/folder name


def _eos_ids(config: dict) -> list[int]:
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [e for e in eos if isinstance(e, int)] if isinstance(eos, list) else []


@dataclass(frozen=True)
class _Source:
    kind: str  # "gguf" | "hf"
    path: Path
    name: str
    chat_template: str | None = None  # shipped template for a bundled model


def _resolve(model: str | os.PathLike) -> _Source:
    spec = os.fspath(model)
    if spec in BUNDLED:
        template = CHAT_TEMPLATES.get(spec)
        return _Source("gguf", locate_bundled(spec), spec, shipped_template(template) if template else None)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _Source("hf", path, path.name)
    if path.is_file():
        return _Source("gguf", path, path.name)
    if path.suffix.lower() == ".gguf" or os.sep in spec or spec.startswith(("~", ".")):
        raise ModelLoadError(f"{path}: no such file or folder")
    locate_bundled(spec)  # a bare word: a mistyped bundled name; raises with the list
    raise ModelLoadError(f"{spec}: cannot be loaded")


def _gguf_tokenizer(src: _Source, header, fp: str, config: dict) -> Tokenizer | None:
    from .tokenizer import load_gguf_tokenizer

    if "tokenizer.ggml.model" not in header.metadata:
        return None  # weights-only GGUF
    template = src.chat_template
    if template is None and "tokenizer.chat_template" not in header.metadata:
        fallback = _FALLBACK_TEMPLATES.get(header.architecture)
        template = shipped_template(fallback) if fallback else None
    return load_gguf_tokenizer(src.path, fp, chat_template=template, extra_eos_ids=_eos_ids(config))


def _hf_eos(config: dict) -> list[int]:
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return _eos_ids(config) or _eos_ids(text_config)


def load_checkpoint(model: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True) -> Checkpoint:
    """Load a bundled model name, a .gguf file, or an HF folder.

    Raises ModelLoadError (one clear line naming the file and the problem) for
    anything that cannot be loaded."""
    src = _resolve(model)
    if src.kind == "gguf":
        from . import gguf

        header, architecture, config, tensors = gguf.load_gguf(src.path, dtype=dtype, progress=progress, desc=src.name)
        fp = gguf.fingerprint(src.path)
        tokenizer = _gguf_tokenizer(src, header, fp, config)
    else:
        from . import hf
        from .tokenizer import load_folder_tokenizer

        architecture, config, tensors = hf.load_hf(src.path, dtype=dtype, progress=progress, desc=src.name)
        fp = hf.fingerprint(src.path)
        tokenizer = load_folder_tokenizer(src.path, fp, extra_eos_ids=_hf_eos(config))
    return Checkpoint(architecture, config, tensors, tokenizer, src.path, fp, src.name)


def load_tokenizer(model: str | os.PathLike) -> Tokenizer | None:
    """Just the tokenizer of what load_checkpoint(model) would load (no tensors read)."""
    src = _resolve(model)
    if src.kind == "gguf":
        from . import gguf

        header = gguf.read_header(src.path)
        arch = gguf.architecture_of(header)
        return _gguf_tokenizer(src, header, gguf.fingerprint(src.path), arch.build_config(header))
    from . import hf
    from .tokenizer import load_folder_tokenizer

    config = hf.read_config(src.path)
    return load_folder_tokenizer(src.path, hf.fingerprint(src.path), extra_eos_ids=_hf_eos(config))
