"""llama.cpp's ``rope_freqs.weight``: how its converter stores Llama 3 style rope scaling.

``convert_hf_to_gguf.py`` (LlamaModel, Exaone4Model, ... ``generate_extra_tensors``) turns
``rope_type: llama3`` with its factor / low_freq_factor / high_freq_factor /
original_max_position_embeddings into one divisor per rotary dimension pair and writes only those
(no ``rope.scaling.*`` keys); llama.cpp divides the base frequencies by them.

``llama3_rope`` reads them back as transformers' ``rope_type: llama3`` parameters when the usual
low_freq_factor 1 / high_freq_factor 4 with an integer original context reproduces every stored
divisor bit for bit through the converter's own arithmetic (then the frequencies are transformers'
exactly); otherwise as ``rope_type: llama3`` with ``freq_factors``, which
``turnkv.models.rope_config.inv_freq_for`` divides by as llama.cpp does (equal to transformers'
frequencies except for a float32 rounding in the dimensions between the two wavelength bounds).
"""

from __future__ import annotations

import math

import torch

from ...errors import ModelLoadError
from ..dequant import dequantize
from ..reader import GGUFHeader, open_mmap, release

NAME = "rope_freqs.weight"


def freq_factors(h: GGUFHeader, rotary_dim: int) -> list[float] | None:
    """The per-dimension divisors, or None when the file has no rope_freqs tensor."""
    info = h.tensors.get(NAME)
    if info is None:
        return None
    if info.shape != (rotary_dim // 2,):
        raise ModelLoadError(f"{h.path}: '{NAME}' has shape {list(info.shape)}, expected [{rotary_dim // 2}]")
    buf, _ = open_mmap(h.path)
    try:
        values = dequantize(buf, info, torch.float32, h.path).tolist()
    finally:
        release(buf)
    return [float(v) for v in values]


def _converter_factors(base: float, dim: int, factor: float, low: float, high: float, old: int) -> list[float]:
    # conversion/llama.py / exaone.py generate_extra_tensors, step for step (float32 tensor ops)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).tolist()


def llama3_rope(factors: list[float], rotary_dim: int, base: float) -> dict:
    """rope_parameters (without rope_theta) for a file's rope_freqs divisors."""
    factor = max(factors)
    low, high = 1.0, 4.0
    if factor > 1:
        freqs = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        candidates = set()
        for freq, rf in zip(freqs.tolist(), factors):
            if 1 < rf < factor:  # between the bounds: 1 / rf = (1 - s) / factor + s
                s = (1 / rf - 1 / factor) / (1 - 1 / factor)
                candidates.add(round(2 * math.pi / freq * (s * (high - low) + low)))
        for old in sorted(candidates):
            if old > 0 and _converter_factors(base, rotary_dim, factor, low, high, old) == factors:
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": old}
    return {"rope_type": "llama3", "freq_factors": factors}
