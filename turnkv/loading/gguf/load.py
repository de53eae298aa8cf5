"""Loading a GGUF file: its architecture's config, every tensor under its transformers name
(dequantized, or kept as the file's quantized blocks), the family's finishing touches."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .architecture import GLOBAL_TENSORS, GGUFArchitecture
from .archs import SUPPORTED_GGUF_ARCHITECTURES
from .dequant import dequantize, expert_stack, keeps_blocks, raw_rows
from .reader import GGUFHeader, TensorInfo, open_mmap, parse_header, parse_header_once, release


def tensor_name_map(h: GGUFHeader, arch: GGUFArchitecture, config: dict) -> dict[str, str]:
    """GGUF tensor name -> transformers name, for every tensor the model needs."""
    if arch.tensor_names is not None:
        names = arch.tensor_names(h, config)
        for g, t in names.items():
            if g not in h.tensors:
                raise ModelLoadError(f"{h.path}: missing tensor '{g}' (transformers name '{t}')")
        return names
    required: dict[str, str] = {}
    optional: dict[str, str] = {}
    for g, t in GLOBAL_TENSORS.items():
        if g == "output" and config.get("tie_word_embeddings"):
            continue
        required[f"{g}.weight"] = f"{t}.weight"
    for i in range(config["num_hidden_layers"]):
        for g, t in arch.layer_tensors.items():
            required[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{t}.weight"
            optional[f"blk.{i}.{g}.bias"] = f"model.layers.{i}.{t}.bias"
    for g, t in required.items():
        if g not in h.tensors:
            raise ModelLoadError(f"{h.path}: missing tensor '{g}' (transformers name '{t}')")
    return required | {g: t for g, t in optional.items() if g in h.tensors}


def architecture_of(h: GGUFHeader) -> GGUFArchitecture:
    arch = h.architecture
    spec = SUPPORTED_GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{h.path}: unsupported architecture '{arch}' in this GGUF file (supported: {supported})"
        )
    return spec


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True, desc: str | None = None,
    quantized: dict | None = None,
) -> tuple[GGUFHeader, str, dict, dict[str, torch.Tensor]]:
    """Read a GGUF file: (header, HF model_type, config dict, transformers-named tensors).

    ``quantized``: a dict to fill (``load_checkpoint(..., keep_quantized=True)``). Every 2-D tensor
    stored in a quantized type then goes there, under its transformers name, as a
    ``turnkv.kernels.GGUFWeight`` of its raw blocks (same row transforms: llama's q/k
    un-permute reorders the raw rows) and is left out of the returned float tensors: no float
    copy of it is ever made. Float-stored tensors (F32/F16/BF16), 1-D tensors, quantized types the
    kernels do not take and tensors whose transform is not a row permutation are dequantized as
    without it."""
    from tqdm.auto import tqdm

    path = Path(path)
    buf, size = open_mmap(path)
    try:
        header = parse_header_once(path, lambda: parse_header(path, buf, size))
        arch = architecture_of(header)
        config = arch.build_config(header)
        names = tensor_name_map(header, arch, config)
        tensors: dict[str, torch.Tensor] = {}
        bar = tqdm(
            names.items(), desc=f"Loading {desc or path.name}", unit="tensor",
            file=sys.stderr, disable=not progress, leave=False,
        )
        for gguf_name, hf_name in bar:
            info = header.tensors[gguf_name]
            stack = expert_stack(gguf_name, info.shape)
            if quantized is not None and keeps_blocks(gguf_name, info) and \
                    (q := _keep_quantized(buf, info, hf_name, arch, config, stack)) is not None:
                # a stack goes through ``finish`` (which fuses or renames the experts)
                (tensors if stack else quantized)[hf_name] = q
                continue
            if arch.transform is not None and arch.needs_transform(hf_name):
                w = dequantize(buf, info, torch.float32, path)
                w = arch.transform(hf_name, w, config).to(dtype)
            else:
                w = dequantize(buf, info, dtype, path)
            tensors[hf_name] = w
        bar.close()
        if arch.finish is not None:
            tensors = arch.finish(tensors, config)
        if quantized is not None:
            _move_blocks(tensors, quantized)
    finally:
        release(buf)
    return header, arch.model_type, config, tensors


def _keep_quantized(buf: mmap.mmap, info: TensorInfo, hf_name: str, arch: GGUFArchitecture, config: dict,
                    stack: bool):
    """The tensor as a GGUFWeight of its raw blocks (``stack``, a 3-D expert stack: a
    GGUFStack), or None when it stays a float tensor."""
    transform = arch.transform is not None and arch.needs_transform(hf_name)
    if transform and (stack or not arch.transform_permutes_rows):
        return None
    from ...kernels import GGUFStack, GGUFWeight

    raw = raw_rows(buf, info)
    if stack:
        return GGUFStack.from_raw(raw, info.qtype, tuple(info.shape))
    # a row permutation, found by applying it to the row numbers: the tiling moves the file's
    # rows to their places, so the permuted rows are never copied on their own
    order = arch.transform(hf_name, torch.arange(raw.shape[0])[:, None], config)[:, 0] if transform else None
    # tiled when first used, or straight into a fused weight's tiles: one copy from the file
    return GGUFWeight.from_raw(raw, info.qtype, tuple(info.shape), defer=True, order=order)



def _move_blocks(tensors: dict, quantized: dict) -> None:
    """What ``finish`` left of the kept expert stacks (a stack, or one expert's GGUFWeight where
    the family splits them) moves from ``tensors`` to ``quantized``."""
    from ...kernels import GGUFStack, GGUFWeight

    for name in [n for n, t in tensors.items() if isinstance(t, (GGUFStack, GGUFWeight))]:
        quantized[name] = tensors.pop(name)
