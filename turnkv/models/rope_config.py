"""Read RoPE settings from an HF config dict (transformers 4.x ``rope_theta``/``rope_scaling`` or
5.x ``rope_parameters``, possibly per layer type)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import UnsupportedConfig


def rope_params(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    out: dict[str, Any] = {}
    if isinstance(params, dict) and "rope_theta" in params:
        out.update(params)
    else:
        scaling = config.get("rope_scaling") or {}
        out.update(scaling)
        out["rope_theta"] = config.get("rope_theta", 10000.0)
    out.setdefault("rope_type", out.get("type", "default") or "default")
    return out


def inv_freq_for(params: dict[str, Any], head_dim: int, partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling as transformers' rope init functions compute them."""
    dim = int(head_dim * partial_rotary_factor)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3" and "freq_factors" in params:
        # a GGUF's llama3 scaling: llama.cpp's converter stores the per-dimension divisors it
        # computes from factor / low / high / original context (rope_freqs.weight), not those
        return inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(params, dim, base)
    # dynamic NTK rescales every position once a sequence outgrows the original context (no
    # position's rotation is final, so a cached K could not be reused); longrope et al. unported
    raise UnsupportedConfig(f"config field rope_type={kind!r} is not supported "
                            "(turnkv computes default, linear, llama3 and yarn RoPE)")


def _yarn(params: dict[str, Any], dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN as transformers' ``_compute_yarn_parameters`` (Ministral 3, gpt-oss): a per-dimension
    blend of the original and the ``factor``-interpolated frequencies, and an attention factor that
    scales cos/sin."""
    old = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(params["max_position_embeddings"]) / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated = 1.0 / (factor * pos_freqs)     # as transformers rounds it (not inv_freq / factor)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation, float(attention)
