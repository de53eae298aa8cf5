"""CacheSpec: the plain data a model family returns to say what state each layer owns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerCache
from .blocks import BlockPool
from .chunked import ChunkedCache
from .kv import KVCache
from .storage import MODES, NATIVE, layer_modes
from .recurrent import StateCache
from .sliding import DEFAULT_SLACK, SlidingWindowCache

FULL, SLIDING, CHUNKED, RECURRENT = "full", "sliding", "chunked", "recurrent"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)


@dataclass(frozen=True)
class CacheSpec:
    kind: str
    heads: int = 0
    head_dim: int = 0
    window: int = 0                                       # sliding
    chunk: int = 0                                        # chunked
    fields: tuple[tuple[str, tuple[int, ...]], ...] = ()  # recurrent: (name, shape) pairs
    state_dtype: str | None = None                        # recurrent: held in this dtype, not the cache's

    @property
    def is_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    def describe(self) -> str:
        if self.kind == SLIDING:
            return f"sliding(window={self.window})"
        if self.kind == CHUNKED:
            return f"chunked(chunk={self.chunk})"
        if self.kind == RECURRENT:
            return "recurrent(" + ", ".join(name for name, _ in self.fields) + ")"
        return "full"


def full(heads: int, head_dim: int) -> CacheSpec:
    return CacheSpec(FULL, heads, head_dim)


def sliding(heads: int, head_dim: int, window: int) -> CacheSpec:
    return CacheSpec(SLIDING, heads, head_dim, window=window)


def chunked(heads: int, head_dim: int, chunk: int) -> CacheSpec:
    return CacheSpec(CHUNKED, heads, head_dim, chunk=chunk)


def recurrent(state_dtype: str | None = None, **fields: tuple[int, ...]) -> CacheSpec:
    """``state_dtype`` ("float32"): hold the state in that dtype whatever the cache dtype (a state
    that transformers keeps in float32, where rounding it to bfloat16 between chunks would add up)."""
    return CacheSpec(RECURRENT, fields=tuple((k, tuple(v)) for k, v in fields.items()), state_dtype=state_dtype)


def all_trimmable(specs: list[CacheSpec]) -> bool:
    """True when every layer can be truncated to any earlier length (only full attention can)."""
    return all(s.kind == FULL for s in specs)


def default_modes(specs: list[CacheSpec], mode: str = NATIVE, boundary_layers: int = 0) -> list[str]:
    return layer_modes([s.is_attention for s in specs], mode, boundary_layers)


def make_pools(specs: list[CacheSpec], dtype: torch.dtype = torch.float32, device="cpu",
               modes: list[str] | None = None) -> list[BlockPool | None]:
    """One KV block pool per attention layer (None for the others), for ``make_caches``."""
    modes = modes or [NATIVE] * len(specs)
    return [BlockPool(mode, spec.heads, spec.head_dim, dtype, device) if spec.is_attention else None
            for spec, mode in zip(specs, modes, strict=True)]


def make_caches(specs: list[CacheSpec], dtype: torch.dtype = torch.float32, device="cpu",
                modes: list[str] | None = None, slack: int = DEFAULT_SLACK,
                pools: list[BlockPool | None] | None = None) -> list[LayerCache]:
    """One live cache per layer; attention layers take their blocks from ``pools`` (shared with
    every other sequence made with the same pools), or from a pool of their own."""
    modes = modes or [NATIVE] * len(specs)
    pools = pools or [None] * len(specs)
    caches: list[LayerCache] = []
    for spec, mode, pool in zip(specs, modes, pools, strict=True):
        if spec.kind == FULL:
            caches.append(KVCache(spec.heads, spec.head_dim, dtype, device, mode, pool=pool))
        elif spec.kind == SLIDING:
            caches.append(SlidingWindowCache(spec.heads, spec.head_dim, spec.window, slack, dtype, device, mode,
                                             pool=pool))
        elif spec.kind == CHUNKED:
            caches.append(ChunkedCache(spec.heads, spec.head_dim, spec.chunk, dtype, device, mode, pool=pool))
        elif spec.kind == RECURRENT:
            state_dtype = getattr(torch, spec.state_dtype) if spec.state_dtype else dtype
            caches.append(StateCache(dict(spec.fields), state_dtype, device))
        else:
            raise ValueError(f"unknown cache kind {spec.kind!r}")
    return caches


def describe_modes(table: list[str], specs: list[CacheSpec] | None = None) -> str:
    """One line for the startup banner and stats, e.g. "int8 on 26 of 30 attention layers".

    With ``specs`` only attention layers are counted (recurrent layers are always native);
    without, every entry of the table is taken for an attention layer."""
    if specs is not None and len(specs) != len(table):
        raise ValueError(f"mode table has {len(table)} entries for {len(specs)} layers")
    modes = [m for i, m in enumerate(table) if specs is None or specs[i].is_attention]
    if not modes:
        return "native (no attention layers)"
    counts = [(m, modes.count(m)) for m in MODES if m != NATIVE and m in modes]
    if not counts:
        return f"native on all {len(modes)} attention layers"
    return ", ".join(f"{m} on {c}" for m, c in counts) + f" of {len(modes)} attention layers"
