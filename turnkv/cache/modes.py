"""KV storage: where attention caches keep K and V, in the layer's storage mode.

A store is a slot array ``[heads, capacity, head_dim]`` for K and V. Caches decide which token
sits in which slot; the store only writes, reads (in the compute dtype), moves and exports
slots. Payloads (what snapshots keep) are dicts of tensors whose dim 1 is the token axis, in
the stored representation: a quantized snapshot keeps the quantized bytes as they are.
"""

from __future__ import annotations

import torch

NATIVE = "native"
MODES = ("native", "bf16", "fp16", "int8", "int4")


def grown_capacity(needed: int, current: int, minimum: int = 256) -> int:
    cap = max(current, minimum)
    while cap < needed:
        cap *= 2
    return cap


class KVStore:
    """Plain float storage; ``native`` keeps the compute dtype, bf16/fp16 cast on write and read."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device, mode: str = NATIVE, capacity: int = 0):
        self.heads, self.head_dim = heads, head_dim
        self.dtype, self.device, self.mode = dtype, torch.device(device), mode
        self.storage_dtype = {"native": dtype, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        self.capacity = 0
        self.k = self.v = None
        if capacity:
            self.grow(capacity, keep=0)

    def _alloc(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.heads, capacity, self.head_dim)
        return (torch.empty(shape, dtype=self.storage_dtype, device=self.device),
                torch.empty(shape, dtype=self.storage_dtype, device=self.device))

    def grow(self, capacity: int, keep: int) -> None:
        if capacity <= self.capacity:
            return
        k, v = self._alloc(capacity)
        if keep:
            k[:, :keep].copy_(self.k[:, :keep])
            v[:, :keep].copy_(self.v[:, :keep])
        self.k, self.v, self.capacity = k, v, capacity

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        self.k[:, slot:slot + n].copy_(k)
        self.v[:, slot:slot + n].copy_(v)

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[:, a:b], self.v[:, a:b]
        if self.storage_dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k, v

    def move(self, src: int, n: int, dst: int) -> None:
        if n <= 0 or src == dst:
            return
        # Overlapping ranges: copy through a temporary (clone) to stay correct.
        self.k[:, dst:dst + n].copy_(self.k[:, src:src + n].clone())
        self.v[:, dst:dst + n].copy_(self.v[:, src:src + n].clone())

    def export(self, a: int, b: int) -> dict[str, torch.Tensor]:
        return {"k": self.k[:, a:b].clone(), "v": self.v[:, a:b].clone()}

    def load(self, slot: int, payload: dict[str, torch.Tensor]) -> None:
        n = payload["k"].shape[1]
        self.k[:, slot:slot + n].copy_(payload["k"])
        self.v[:, slot:slot + n].copy_(payload["v"])

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        return 2 * self.heads * self.head_dim * torch.empty((), dtype=self.storage_dtype).element_size()


def payload_len(payload: dict[str, torch.Tensor]) -> int:
    return next(iter(payload.values())).shape[1]


def slice_payload(payload: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    return {name: t[:, a:b] for name, t in payload.items()}


STORES: dict[str, type[KVStore]] = {"native": KVStore, "bf16": KVStore, "fp16": KVStore}


def make_store(mode: str, heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 0) -> KVStore:
    if mode not in STORES:
        raise ValueError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(MODES)}")
    return STORES[mode](heads, head_dim, dtype, device, mode=mode, capacity=capacity)


def layer_modes(attention_layers: list[bool], mode: str = NATIVE, boundary_layers: int = 0) -> list[str]:
    """Per-layer mode table: ``mode`` on attention layers except the first and last
    ``boundary_layers`` attention layers; ``native`` everywhere else."""
    if mode not in MODES:
        raise ValueError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(MODES)}")
    attn_idx = [i for i, a in enumerate(attention_layers) if a]
    kept = set(attn_idx[:boundary_layers]) | set(attn_idx[len(attn_idx) - boundary_layers:] if boundary_layers else [])
    return [mode if (a and i not in kept) else NATIVE for i, a in enumerate(attention_layers)]
