"""Model loading: a bundled name, a .gguf file or an HF folder -> Checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
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
    "bos_to_add",
    "gguf_path",
    "gguf_runs_quantized",
    "gguf_type_summary",
    "load_checkpoint",
    "source_kind",
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
    # transformers name -> turnkv.kernels.GGUFWeight: the GGUF's quantized 2-D tensors kept as
    # their raw blocks (load_checkpoint(..., keep_quantized=True)); those names are then absent
    # from ``tensors``
    quantized: dict = field(default_factory=dict)
    kind: str = "gguf"  # "gguf" | "hf": what was loaded
    # a text GGUF joined with a vision projector (mmproj): the image settings its metadata gives
    # (models/vision_settings.VisionSettings); None for a folder (the family reads its files)
    image_settings: object = None


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
    from .tokenizer_convert import load_gguf_tokenizer

    if "tokenizer.ggml.model" not in header.metadata:
        return None  # weights-only GGUF
    template = src.chat_template
    if template is None and "tokenizer.chat_template" not in header.metadata:
        fallback = _FALLBACK_TEMPLATES.get(header.architecture)
        template = shipped_template(fallback) if fallback else None
    if header.metadata["tokenizer.ggml.model"] == "rwkv":
        from .rwkv_tokenizer import load_rwkv_world_tokenizer

        return load_rwkv_world_tokenizer(src.path, header.metadata, chat_template=template,
                                         extra_eos_ids=_eos_ids(config))
    return load_gguf_tokenizer(src.path, fp, chat_template=template, extra_eos_ids=_eos_ids(config),
                               metadata=header.metadata)


def _hf_eos(config: dict) -> list[int]:
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return _eos_ids(config) or _eos_ids(text_config)


def _mmproj_path(src: _Source, mmproj) -> Path | None:
    """The vision projector joined to ``src``: ``mmproj`` when it names a file, none when it is
    False, else (None) an ``mmproj*.gguf`` beside a .gguf file given by path (llama.cpp's discovery)."""
    if mmproj is False:
        return None
    if mmproj is not None:
        path = Path(os.fspath(mmproj)).expanduser()
        if src.kind != "gguf":
            raise ModelLoadError(f"{path}: --mmproj pairs a vision projector with a text GGUF, and "
                                 f"{src.path} is a Hugging Face folder (it holds its own vision tower)")
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file (--mmproj)")
        return path
    if src.kind != "gguf" or src.name in BUNDLED:
        return None
    from .gguf.mmproj import find_sibling

    return find_sibling(src.path)


def source_kind(model: str | os.PathLike, mmproj=None) -> tuple[str, str | None]:
    """("gguf", model_type) for a bundled name or a .gguf file (its header read, no tensors; the
    vision family's model type when a projector joins it, see load_checkpoint's ``mmproj``), or
    ("hf", None) for a Hugging Face folder."""
    src = _resolve(model)
    if src.kind != "gguf":
        _mmproj_path(src, mmproj)      # refuses --mmproj on a folder
        return src.kind, None
    from . import gguf

    text_type = gguf.architecture_of(gguf.read_header(src.path)).model_type
    if (path := _mmproj_path(src, mmproj)) is not None:
        from .gguf.mmproj import layout_of

        return "gguf", layout_of(path, text_type).model_type
    return "gguf", text_type


def gguf_path(model: str | os.PathLike) -> Path:
    """The .gguf file of a bundled name or a path (ModelLoadError for anything else)."""
    src = _resolve(model)
    if src.kind != "gguf":
        raise ModelLoadError(f"{model}: not a GGUF file")
    return src.path


def gguf_runs_quantized(model: str | os.PathLike) -> bool:
    """Whether a bundled name or .gguf file has 2-D tensors (or expert stacks) in a type turnkv's GGUF kernels run
    (F16 / BF16 included; a GGUF stored in float32 has none: ``--weights gguf`` has nothing to run on)."""
    src = _resolve(model)
    if src.kind != "gguf":
        return False
    from . import gguf

    header = gguf.read_header(src.path)
    return any(len(t.shape) in (2, 3) and gguf.gguf_kernel_supports(t.qtype) for t in header.tensors.values())


def gguf_type_summary(model: str | os.PathLike, quantized: dict | None = None) -> str | None:
    """Per quantization type of a bundled name or .gguf file, which kernel runs its tensors and
    which are float32 copies (``turnkv.kernels.describe_types``); ``quantized``: a loaded
    ``Checkpoint.quantized``, to count what the load really kept. None for an HF folder."""
    src = _resolve(model)
    if src.kind != "gguf":
        return None
    from ..kernels import describe_types
    from . import gguf

    header = gguf.read_header(src.path)
    infos = list(header.tensors.values())
    if quantized is None:   # what a load keeps: 2-D tensors and expert stacks of a type with a kernel
        kept = {}
        for name, t in header.tensors.items():
            if gguf.keeps_blocks(name, t):
                kept[t.qtype] = kept.get(t.qtype, 0) + 1
    else:
        # what the load read: a tensor the model never reads (RWKV-7's dummy layer-0 value LoRA) is no copy
        arch = gguf.architecture_of(header)
        infos = [header.tensors[g] for g in gguf.tensor_name_map(header, arch, arch.build_config(header))]
        kept, seen = {}, set()
        for w in quantized.values():
            stack = getattr(w, "base", None) or w       # an expert's weight counts as its stack
            if id(stack) not in seen:
                seen.add(id(stack))
                kept[w.qtype] = kept.get(w.qtype, 0) + getattr(stack, "sources", 1)
    return describe_types([(t.qtype, t.shape) for t in infos], kept)


# GGUF vocabularies whose text starts with BOS when the file does not say (llama.cpp's llama-vocab.cpp:
# SentencePiece and WordPiece vocabularies, and BPE ones with Llama 3's pre-tokenizer or a kin of it)
_BOS_VOCABS = ("llama", "bert")
_BOS_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")


def bos_to_add(model: str | os.PathLike, tokenizer: Tokenizer) -> int | None:
    """The BOS id that starts a text for ``model`` (None: none does), decided as llama.cpp decides
    for a GGUF (``tokenizer.ggml.add_bos_token``, else its vocabulary type's default; Gemma 4's
    pre-tokenizer always adds it) and as the folder's own tokenizer does for an HF folder."""
    src = _resolve(model)
    if src.kind != "gguf":
        bos = tokenizer.bos_token_id
        adds = bos is not None and tokenizer.encode("a")[:1] == [bos] and tokenizer.encode("a", False)[:1] != [bos]
        return bos if adds else None
    from . import gguf

    meta = gguf.read_header(src.path).metadata
    vocab, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "")
    default = vocab in _BOS_VOCABS or pre in _BOS_PRES
    adds = bool(meta.get("tokenizer.ggml.add_bos_token", default)) or "gemma4" in (vocab, pre)
    bos = meta.get("tokenizer.ggml.bos_token_id", tokenizer.bos_token_id)
    return int(bos) if adds and bos is not None else None


def load_checkpoint(model: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True,
                    keep_quantized: bool = False, mmproj=None) -> Checkpoint:
    """Load a bundled model name, a .gguf file, or an HF folder.

    ``mmproj``: a vision projector GGUF (llama.cpp's mmproj) joined to a text GGUF into its vision
    family (loading/gguf/mmproj/); None finds an ``mmproj*.gguf`` beside a .gguf file, False never
    joins one.

    ``keep_quantized``: the GGUF's quantized 2-D tensors go to ``Checkpoint.quantized`` as their
    raw blocks (``turnkv.kernels.GGUFWeight``), without a float copy; for the ``gguf`` weight
    format. An HF folder has no such blocks: ModelLoadError.

    Raises ModelLoadError (one clear line naming the file and the problem) for
    anything that cannot be loaded."""
    src = _resolve(model)
    quantized: dict = {}
    if keep_quantized and src.kind != "gguf":
        raise ModelLoadError(
            f"{src.path}: --weights gguf runs a GGUF file's own quantized blocks, and this is a Hugging "
            f"Face folder (safetensors); use --weights native (or bf16, int8, int4x2, int4, auto)")
    if src.kind == "gguf":
        from . import gguf

        header, architecture, config, tensors = gguf.load_gguf(
            src.path, dtype=dtype, progress=progress, desc=src.name, quantized=quantized if keep_quantized else None)
        fp = gguf.fingerprint(src.path)
        tokenizer = _gguf_tokenizer(src, header, fp, config)
        if (mm_path := _mmproj_path(src, mmproj)) is not None:
            from .gguf.mmproj import load_mmproj

            mm = load_mmproj(mm_path, header, architecture, config, dtype, progress)
            architecture, config = mm.config["model_type"], mm.config
            tensors, quantized = {**mm.join(tensors), **mm.tensors}, mm.join(quantized)
            fp = f"{fp}+mmproj:{mm.fingerprint}"
            return Checkpoint(architecture, config, tensors, tokenizer, src.path, fp, src.name, quantized,
                              src.kind, mm.settings)
    else:
        from . import hf
        from .tokenizer_convert import load_folder_tokenizer

        _mmproj_path(src, mmproj)      # refuses --mmproj on a folder
        architecture, config, tensors = hf.load_hf(src.path, dtype=dtype, progress=progress, desc=src.name)
        fp = hf.fingerprint(src.path)
        tokenizer = load_folder_tokenizer(src.path, fp, extra_eos_ids=_hf_eos(config))
    return Checkpoint(architecture, config, tensors, tokenizer, src.path, fp, src.name, quantized, src.kind)


def load_tokenizer(model: str | os.PathLike) -> Tokenizer | None:
    """Just the tokenizer of what load_checkpoint(model) would load (no tensors read)."""
    src = _resolve(model)
    if src.kind == "gguf":
        from . import gguf

        header = gguf.read_header(src.path)
        arch = gguf.architecture_of(header)
        return _gguf_tokenizer(src, header, gguf.fingerprint(src.path), arch.build_config(header))
    from . import hf
    from .tokenizer_convert import load_folder_tokenizer

    config = hf.read_config(src.path)
    return load_folder_tokenizer(src.path, hf.fingerprint(src.path), extra_eos_ids=_hf_eos(config))
