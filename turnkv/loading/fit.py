"""Whether a GGUF model fits this machine's memory, checked from its header before the load: a
model that cannot fit fails at once, naming both sizes, instead of after minutes of loading when
the kernel's out-of-memory killer ends the process.

What a load keeps resident is computed as the load does it: a tensor kept in its GGUF blocks
(``--weights gguf``: the types the kernels run) costs its stored bytes, every other tensor its
element count in the float type it is loaded in. The K/V pools reserve address space only
(cache/slots.py), so they are not counted; the prompt cache stays within its budget."""

from __future__ import annotations

import os

import torch

from ..page_arena import available_bytes, held_bytes
from .errors import ModelLoadError

GiB = 1 << 30


def resident_bytes(header, keep_quantized: bool, dtype: torch.dtype) -> int:
    """What loading the GGUF ``header`` describes keeps in memory (see the module)."""
    from .gguf import keeps_blocks

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, info in header.tensors.items():
        if keep_quantized and keeps_blocks(name, info):
            total += info.nbytes
        else:
            n = 1
            for d in info.shape:
                n *= int(d)
            total += n * (size if len(info.shape) >= 2 else 4)
    return total


def check_fits(path: str | os.PathLike, keep_quantized: bool, dtype: torch.dtype, available: int | None = None) -> None:
    """ModelLoadError when the GGUF at ``path`` needs more memory than ``available`` (default:
    MemAvailable, plus the pages ``serve`` faulted in for the tiles: turnkv/page_arena.py) as it
    would be loaded."""
    from .gguf import read_header

    avail = available_bytes() if available is None else available
    if avail is None:
        return
    if available is None:    # serve's faulted-in pages for the tiles are this load's own
        avail += held_bytes()
    header = read_header(path)
    need = resident_bytes(header, keep_quantized, dtype)
    if need > avail:
        how = "kept in its GGUF blocks" if keep_quantized else f"as {str(dtype).replace('torch.', '')} tensors"
        raise ModelLoadError(
            f"{header.path.name}: its weights need {need / GiB:.1f} GiB of memory ({how}), but only "
            f"{avail / GiB:.1f} GiB is available (MemAvailable). Free memory, or use a smaller model or "
            f"quantization" + ("" if keep_quantized else " (or --weights gguf, which keeps the file's blocks)"))
