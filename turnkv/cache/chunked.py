"""Chunked attention KV (Llama 4 local layers): a query at ``p`` sees positions from the start of
its chunk, ``(p // chunk) * chunk``, up to ``p``.

The live cache releases whole blocks before the current chunk; a snapshot holds from the block
boundary at or before the start of its last chunk, so it can be restored to ``t`` only while
``t``'s chunk start is still held (``start <= (t // chunk) * chunk``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .kv import DEFAULT_BLOCK, ChunkedSnapshot, KVCache
from .storage import NATIVE


class ChunkedCache(KVCache):
    kind: ClassVar[str] = "chunked"
    snapshot_type = ChunkedSnapshot

    def __init__(self, heads: int, head_dim: int, chunk: int, dtype: torch.dtype = torch.float32,
                 device="cpu", mode: str = NATIVE, block_size: int = DEFAULT_BLOCK, pool=None):
        if chunk < 1:
            raise ValueError(f"attention chunk size {chunk} out of range")
        self.chunk = chunk
        super().__init__(heads, head_dim, dtype, device, mode, block_size, pool)

    def needed_from(self, t: int) -> int:
        return (t // self.chunk) * self.chunk

    @property
    def span(self) -> int:
        return self.chunk

    def needed_from_many(self, qpos: torch.Tensor) -> torch.Tensor:
        return torch.div(qpos, self.chunk, rounding_mode="floor") * self.chunk

    def signature(self) -> tuple:
        return (self.kind, self.heads, self.head_dim, self.chunk, str(self.dtype))

    def _snapshot_extra(self) -> dict:
        return {"chunk": self.chunk}
