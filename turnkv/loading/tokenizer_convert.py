"""Tokenizers that need converting: a GGUF vocabulary, or a folder holding only slow tokenizer
files, is converted to a tokenizer.json by transformers once per model and cached under
`$TURNKV_CACHE_DIR/tokenizers/<fingerprint>/` (default ~/.cache/turnkv)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import ModelLoadError
from .pretokenizers import apply_gguf_pre_tokenizer
from .tokenizer import Tokenizer, cache_root, folder_chat_template, read_json

CACHE_FORMAT = 2      # 2: GGUF BPE vocabularies split with llama.cpp's regexes for the file
_MARKER = "turnkv-tokenizer.json"


def _converted_folder(fingerprint: str, source: Path, convert) -> Path:
    """Return a folder holding tokenizer.json for `fingerprint`, converting once."""
    folder = cache_root() / "tokenizers" / fingerprint
    marker = _read_json_quiet(folder / _MARKER)
    if marker and marker.get("format") == CACHE_FORMAT and (folder / "tokenizer.json").is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{fingerprint[:16]}-", dir=folder.parent))
    except OSError:  # read-only cache location: convert into a throwaway folder
        tmp = Path(tempfile.mkdtemp(prefix="turnkv-tokenizer-"))
        convert(tmp)
        return tmp
    try:
        convert(tmp)
        (tmp / _MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "source": str(source)}))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:
        if (folder / _MARKER).is_file():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        return tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _read_json_quiet(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _transformers_convert(load_kwargs: dict, what: Path):
    def convert(out: Path) -> None:
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                try:
                    tok = AutoTokenizer.from_pretrained(local_files_only=True, **load_kwargs)
                except Exception as e:
                    # AutoTokenizer reads a GGUF's model config first and knows few GGUF
                    # architectures (ValueError), or misreads one (TypeError: its gpt-oss rope
                    # keys; a strict-dataclass error: Gemma 4's per-layer feed_forward_length);
                    # the tokenizer (tokenizer.ggml.*) does not depend on it.
                    from huggingface_hub.errors import StrictDataclassError

                    config_error = (ValueError, TypeError, StrictDataclassError)
                    if "gguf_file" not in load_kwargs or not isinstance(e, config_error) or (
                            isinstance(e, ValueError) and "is not supported yet" not in str(e)):
                        raise
                    from transformers import PreTrainedTokenizerFast

                    tok = PreTrainedTokenizerFast.from_pretrained(local_files_only=True, **load_kwargs)
            finally:
                hf_logging.set_verbosity(verbosity)
            if not getattr(tok, "is_fast", True) or not hasattr(tok, "backend_tokenizer"):
                raise ValueError(f"got a {type(tok).__name__} without a fast tokenizer")
            tok.save_pretrained(str(out))
            if not (out / "tokenizer.json").is_file():
                tok.backend_tokenizer.save(str(out / "tokenizer.json"))
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{what}: cannot convert the tokenizer with transformers ({e})") from None

    return convert


def load_gguf_tokenizer(
    path: Path, fingerprint: str, *, chat_template: str | None = None, extra_eos_ids: Iterable[int] = (),
    metadata: dict | None = None,
) -> Tokenizer:
    """Tokenizer of a GGUF file, converted by transformers once and cached; a BPE vocabulary then
    splits text with llama.cpp's regexes for the file's pre-tokenizer (loading/pretokenizers.py),
    so its token ids are llama.cpp's. ``metadata``: the file's header metadata."""
    path = Path(path).resolve()
    hf_convert = _transformers_convert({"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}, path)

    def convert(out: Path) -> None:
        hf_convert(out)
        file = out / "tokenizer.json"
        converted = apply_gguf_pre_tokenizer(json.loads(file.read_text(encoding="utf-8")), metadata or {})
        file.write_text(json.dumps(converted, ensure_ascii=False), encoding="utf-8")

    folder = _converted_folder(fingerprint, path, convert)
    return Tokenizer.from_folder(folder, chat_template=chat_template, extra_eos_ids=extra_eos_ids)


_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


def load_folder_tokenizer(
    folder: Path, fingerprint: str, *, chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()
) -> Tokenizer | None:
    """Tokenizer of an HF folder, or None when the folder has no tokenizer files."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_folder(folder, chat_template=chat_template, extra_eos_ids=extra_eos_ids)
    if not any((folder / name).is_file() for name in _SLOW_TOKENIZER_FILES[:3]):
        return None
    convert = _transformers_convert({"pretrained_model_name_or_path": str(folder)}, folder)
    converted = _converted_folder(fingerprint, folder, convert)
    template = chat_template or folder_chat_template(folder, read_json(folder / "tokenizer_config.json") or {})
    return Tokenizer.from_folder(converted, chat_template=template, extra_eos_ids=extra_eos_ids)
