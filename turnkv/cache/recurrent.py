"""Recurrent and convolutional state (Mamba, LFM2 short conv, gated delta-net): named fixed-size
tensors that summarise every token seen. They cannot be rewound: a snapshot restores only to its
own length, which is why hybrid families take checkpoints at message boundaries. The one live cut
is inside a verified draft (docs/speculative.md): while a cache keeps a trail, the model runs its
tokens one at a time and every state it writes is kept, so the state after any of them can be
picked back."""

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
        self.trail: dict[str, list[torch.Tensor]] | None = None   # states written since keep_trail
        self.trail_base = 0

    def signature(self) -> tuple:
        return (self.kind, tuple(sorted(self.fields.items())), str(self.dtype))

    def set(self, name: str, value: torch.Tensor) -> None:
        self.state[name].copy_(value)
        if self.trail is not None:
            self.trail.setdefault(name, []).append(self.state[name].clone())

    def keep_trail(self) -> None:
        """Keep every state written from here on (the model then runs this cache's tokens one at
        a time: models/batch.py ``spans_apply``), until ``truncate`` picks one or drops them."""
        self.trail, self.trail_base = {}, self.offset

    def can_truncate_to(self, length: int) -> bool:
        """The current length, or a length inside the trail when every field was written once
        per token of it."""
        if length == self.offset:
            return True
        n = self.offset - self.trail_base
        return (self.trail is not None and self.trail_base < length < self.offset
                and all(len(self.trail.get(name, ())) == n for name in self.fields))

    def truncate(self, length: int) -> None:
        if length != self.offset:
            if not self.can_truncate_to(length):
                super().truncate(length)       # raises, naming the kind
            for name, states in self.trail.items():
                self.state[name].copy_(states[length - self.trail_base - 1])
            self.offset = length
        self.trail = None

    def advance(self, T: int) -> None:
        self.offset += T

    def reset(self) -> None:
        for t in self.state.values():
            t.zero_()
        self.offset, self.trail = 0, None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def snapshot(self) -> StateSnapshot:
        part = StoredPart({name: t.clone() for name, t in self.state.items()})
        return StateSnapshot(length=self.offset, mode=self.mode, signature=self.signature(), state=part)

    def _load(self, snap: StateSnapshot, length: int) -> None:
        for name, t in snap.state.tensors.items():
            self.state[name].copy_(t)
        self.offset, self.trail = length, None
