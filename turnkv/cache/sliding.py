"""Sliding-window KV (Gemma 3 local layers): a query at ``p`` sees positions ``p - window + 1 .. p``.

The live cache keeps ``window - 1 + slack`` past tokens (whole blocks: up to a block more), so a
snapshot can be restored to any ``t`` with ``length - t <= slack`` even after the window has
wrapped: the exact rule is ``start <= t - window + 1`` (see kv.py), and snapshots start at a block
boundary at or before ``length - (window - 1 + slack)``, so the guaranteed slack is at least ``slack``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .kv import DEFAULT_BLOCK, KVCache, SlidingSnapshot
from .storage import NATIVE

DEFAULT_SLACK = 256


class SlidingWindowCache(KVCache):
    kind: ClassVar[str] = "sliding"
    snapshot_type = SlidingSnapshot

    def __init__(self, heads: int, head_dim: int, window: int, slack: int = DEFAULT_SLACK,
                 dtype: torch.dtype = torch.float32, device="cpu", mode: str = NATIVE,
                 block_size: int = DEFAULT_BLOCK, pool=None):
        if window < 1 or slack < 0:
            raise ValueError(f"sliding window {window} / slack {slack} out of range")
        self.window, self.slack = window, slack
        super().__init__(heads, head_dim, dtype, device, mode, block_size, pool)

    @property
    def keep(self) -> int:
        return self.window - 1 + self.slack

    def needed_from(self, t: int) -> int:
        return max(0, t - self.window + 1)

    @property
    def span(self) -> int:
        return self.window

    def needed_from_many(self, qpos: torch.Tensor) -> torch.Tensor:
        return (qpos - self.window + 1).clamp(min=0)

    def retain_from(self, pos: int) -> int:
        return max(0, pos - self.keep)

    def signature(self) -> tuple:
        return (self.kind, self.heads, self.head_dim, self.window, str(self.dtype))

    def _snapshot_extra(self) -> dict:
        return {"window": self.window}
