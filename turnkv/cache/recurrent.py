"""Recurrent and convolutional state (Mamba, LFM2 short conv, gated delta-net): named fixed-size
tensors that summarise every token seen. They cannot be rewound: a snapshot restores only to its
own length, which is why hybrid families take checkpoints at message boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import LayerCache, LayerSnapshot, StoredPart
from .storage import NATIVE


@dataclass(frozen=True, eq=False)
class StateSnapshot(LayerSnapshot):
    kind: ClassVar[str] = "recurrent"
    state: StoredPart | None = None

    def parts(self) -> list[StoredPart]:
        return [self.state] if self.state is not None else []


class StateCache(LayerCache):
    """Named state tensors. The model reads ``cache.state[name]``, writes it in place or through
    ``cache.set(name, value)``, and calls ``cache.advance(T)`` after consuming ``T`` tokens."""

    kind: ClassVar[str] = "recurrent"
    snapshot_type = StateSnapshot

    def __init__(self, fields: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32, device="cpu"):
        self.fields = {name: tuple(shape) for name, shape in fields.items()}
        self.dtype, self.device, self.mode = dtype, torch.device(device), NATIVE
        self.state = {name: torch.zeros(shape, dtype=dtype, device=self.device) for name, shape in self.fields.items()}
        self.offset = 0

    def signature(self) -> tuple:
        return (self.kind, tuple(sorted(self.fields.items())), str(self.dtype))

    def set(self, name: str, value: torch.Tensor) -> None:
        self.state[name].copy_(value)

    def advance(self, T: int) -> None:
        self.offset += T

    def reset(self) -> None:
        for t in self.state.values():
            t.zero_()
        self.offset = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def snapshot(self) -> StateSnapshot:
        part = StoredPart({name: t.clone() for name, t in self.state.items()})
        return StateSnapshot(length=self.offset, mode=self.mode, signature=self.signature(), state=part)

    def _load(self, snap: StateSnapshot, length: int) -> None:
        for name, t in snap.state.tensors.items():
            self.state[name].copy_(t)
        self.offset = length
