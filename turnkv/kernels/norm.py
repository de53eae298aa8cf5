"""RMSNorm as one native call (csrc/norm.cpp): ``torch.ops.turnkv_ops.rms_norm(x, weight, eps)``.

torch runs ``F.rms_norm`` on CPU as six ATen ops (~10 us for a 640-wide row, nearly all dispatch);
a decode step normalizes 60-90 times. The native op is one call (~2 us) that reduces each row in
a fixed order (8 lanes, then a fixed tree), so a row's result is the same bits in any batch and
on any CPU; it equals ``F.rms_norm`` within float32 rounding (tests/test_kernels.py).
``TURNKV_NORM=reference`` keeps torch's (A/B).
"""

from __future__ import annotations

import os

import torch

from . import native_available


def native_rms_norm():
    """The op, or None (no build, a build from before it, or TURNKV_NORM=reference)."""
    if not native_available() or os.environ.get("TURNKV_NORM", "").strip().lower() == "reference":
        return None
    try:
        return torch.ops.turnkv_ops.rms_norm
    except (AttributeError, RuntimeError):
        return None
