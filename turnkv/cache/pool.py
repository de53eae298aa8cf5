"""The engine's live state: a pool of per-sequence state slots, each one sequence's caches for every
layer plus the tokens they hold and the identity a snapshot of them carries.

A slot is taken when a sequence is admitted and given back when it ends; its buffers stay
allocated (fresh pages are slow on these machines) and keep what they held, which is what makes a
returning conversation cheap: ``acquire`` hands out the free slot whose tokens share the longest
prefix with the new prompt, and restoring a snapshot whose KV blocks that slot still holds copies
nothing (cache/kv.py). Snapshot blocks are immutable and shared between snapshots and slots; what
is copied on a restore into another slot is the KV of the restored prefix (recurrent state is
small and always copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerCache
from .snapshot import ModelSnapshot, restore_snapshot, take_snapshot
from .specs import CacheSpec, make_caches


@dataclass(frozen=True)
class StateIdentity:
    """What a snapshot must share with the live state to be restored into it."""

    family: str
    fingerprint: str
    modes: tuple[str, ...]


class SeqState:
    """One slot: a sequence's caches for every layer and the tokens they hold."""

    def __init__(self, identity: StateIdentity, caches: list[LayerCache], index: int = 0):
        self.identity, self.caches, self.index = identity, caches, index
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def snapshot(self, logits: torch.Tensor | None = None) -> ModelSnapshot:
        i = self.identity
        return take_snapshot(self.caches, i.family, i.fingerprint, i.modes, logits=logits)

    @torch.inference_mode()
    def restore(self, snap: ModelSnapshot, length: int, tokens: list[int]) -> None:
        """All-or-nothing (raises SnapshotMismatch before touching anything); ``tokens`` are the
        ``length`` tokens the restored state holds."""
        i = self.identity
        restore_snapshot(self.caches, snap, length, i.family, i.fingerprint, i.modes)
        self.tokens = list(tokens[:length])

    @torch.inference_mode()
    def reset(self) -> None:
        for c in self.caches:
            c.reset()
        self.tokens = []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StatePool:
    """Up to ``size`` slots, created on first use."""

    def __init__(self, specs: list[CacheSpec], identity: StateIdentity, dtype: torch.dtype, device,
                 slack: int, size: int):
        if size < 1:
            raise ValueError(f"the state pool needs at least one slot, got {size}")
        self.specs, self.identity, self.dtype, self.device, self.slack = specs, identity, dtype, device, slack
        self.size = size
        self.slots: list[SeqState] = []
        self.free: list[SeqState] = []

    def _new(self) -> SeqState:
        caches = make_caches(self.specs, self.dtype, self.device, list(self.identity.modes), self.slack)
        slot = SeqState(self.identity, caches, len(self.slots))
        self.slots.append(slot)
        return slot

    def acquire(self, prompt: list[int]) -> SeqState:
        """The free slot whose held tokens share the longest prefix with ``prompt`` (a fresh slot
        when none shares any and the pool may still grow)."""
        best, best_n = None, 0
        for slot in self.free:
            n = common_prefix(slot.tokens, prompt)
            if n > best_n or best is None:
                best, best_n = slot, n
        if (best is None or best_n == 0) and len(self.slots) < self.size:
            return self._new()
        if best is None:
            raise RuntimeError("no free state slot")
        self.free.remove(best)
        return best

    def release(self, slot: SeqState) -> None:
        self.free.append(slot)

    @property
    def live_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def held_parts(self) -> list:
        """Stored parts the slots' caches keep references to (see LayerCache.held_parts)."""
        return [p for slot in list(self.slots) for c in slot.caches for p in c.held_parts()]
