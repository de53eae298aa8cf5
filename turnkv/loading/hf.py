"""HF folder (config.json + *.safetensors, maybe sharded) -> (config dict, tensors).

Tensor names are kept exactly as stored (transformers' CausalLM names, e.g.
"model.layers.0.self_attn.q_proj.weight"); floating tensors are cast to the
requested dtype. A tied lm_head is dropped, as the GGUF loader never emits one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import torch

from .errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


NEVER_TIED = ("kimi_linear", "bailing_hybrid")

def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (an HF model folder needs config.json and *.safetensors)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{path}: has no 'model_type'")
    return config


def shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard(s) that are not in the folder: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files (only safetensors weights are supported)")
    return files


def _read_safetensors_header(path: Path) -> bytes:
    """The raw JSON header of a safetensors file, validated."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or 8 + n > size:
                raise ModelLoadError(
                    f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except ValueError:
        raise ModelLoadError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelLoadError(f"{path}: file is truncated (tensor data needs {8 + n + end} bytes, file has {size})")
    return raw


def fingerprint(folder: Path) -> str:
    """sha256 of config.json and every shard's name, size and header: cheap, stable."""
    folder = Path(folder)
    h = hashlib.sha256(b"hf|")
    h.update((folder / "config.json").read_bytes())
    for shard in shard_files(folder):
        h.update(f"|{shard.name}|{shard.stat().st_size}|".encode())
        h.update(_read_safetensors_header(shard))
    return h.hexdigest()


def _add_rope_aliases(config: dict) -> None:
    # transformers 5 writes rope settings under rope_parameters only; keep the
    # flat names too so both spellings work (the GGUF loader emits both).
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    for layer_type, key in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
        sub = rope.get(layer_type)
        if isinstance(sub, dict) and "rope_theta" in sub:
            config.setdefault(key, sub["rope_theta"])


def load_hf(
    folder: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True, desc: str | None = None
) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(model_type, config dict, tensors) of an HF folder."""
    from safetensors import SafetensorError, safe_open
    from tqdm.auto import tqdm

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder")
    config = read_config(folder)
    if "text_config" not in config:
        _add_rope_aliases(config)
    shards = shard_files(folder)
    for shard in shards:
        _read_safetensors_header(shard)

    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(desc=f"Loading {desc or folder.name}", unit="tensor", file=sys.stderr, disable=not progress, leave=False)
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
                for key in keys:
                    t = f.get_tensor(key)
                    if t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                    tensors[key] = t
                    bar.update()
        except SafetensorError as e:
            raise ModelLoadError(f"{shard}: corrupt safetensors file ({e})") from None
    bar.close()

    # transformers never ties these families' lm_head (their _tied_weights_keys are empty): a
    # stored head is the one it runs, whatever tie_word_embeddings says
    tied = config.get("tie_word_embeddings", False) and config.get("model_type") not in NEVER_TIED
    if tied and "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        del tensors["lm_head.weight"]
    return config["model_type"], config, tensors
