"""A model's state at one point of a token sequence: every layer's snapshot plus what must match
for a restore to be exact (family, weights fingerprint, per-layer KV-mode table).

A model snapshot can be restored to ``t`` only if every layer can. Each layer's restorable lengths
form an interval ``[length - max_trim, length]`` (attention: ``needed_from`` is monotone; recurrent:
the single point ``length``), so the model's set is the interval ``[min_restore(), length]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (
    FAMILY_MISMATCH,
    KV_MODE_MISMATCH,
    LENGTH_OUT_OF_RANGE,
    LayerCache,
    LayerSnapshot,
    SnapshotMismatch,
    StoredPart,
    check_all_restorable,
)

FINGERPRINT_MISMATCH = "fingerprint_mismatch"


def layer_min_restore(snap: LayerSnapshot) -> int:
    """The shortest length one layer snapshot can be restored to."""
    return snap.length - min(snap.length, snap.max_trim)


@dataclass(frozen=True, eq=False)
class ModelSnapshot:
    family: str
    fingerprint: str
    modes: tuple[str, ...]              # per-layer KV mode table
    length: int
    layers: tuple[LayerSnapshot, ...]
    logits: torch.Tensor | None = None  # next-token logits after exactly ``length`` tokens

    def can_restore_to(self, t: int) -> bool:
        return 0 <= t <= self.length and all(layer.can_restore_to(t) for layer in self.layers)

    def min_restore(self) -> int:
        return max((layer_min_restore(layer) for layer in self.layers), default=0)

    def parts(self) -> list[StoredPart]:
        return [part for layer in self.layers for part in layer.parts()]

    @property
    def logits_nbytes(self) -> int:
        return 0 if self.logits is None else self.logits.numel() * self.logits.element_size()

    @property
    def nbytes(self) -> int:
        unique = {part.uid: part.nbytes for part in self.parts()}
        return sum(unique.values()) + self.logits_nbytes


def take_snapshot(caches: list[LayerCache], family: str, fingerprint: str, modes,
                  logits: torch.Tensor | None = None) -> ModelSnapshot:
    offsets = {cache.offset for cache in caches}
    if len(offsets) > 1:
        raise ValueError(f"layers disagree on the number of tokens consumed: {sorted(offsets)}")
    modes = tuple(modes)
    if len(modes) != len(caches):
        raise ValueError(f"mode table has {len(modes)} entries for {len(caches)} layers")
    # The caller's logits tensor may be a view of a buffer it reuses; the snapshot must not alias it.
    kept = None if logits is None else logits.detach().clone()
    return ModelSnapshot(family=family, fingerprint=fingerprint, modes=modes,
                         length=offsets.pop() if offsets else 0,
                         layers=tuple(cache.snapshot() for cache in caches), logits=kept)


def check_model_restore(caches: list[LayerCache], snap: ModelSnapshot, length: int, family: str,
                        fingerprint: str, modes) -> None:
    """Raise the first reason ``snap`` cannot be restored to ``length`` into ``caches``; touches nothing."""
    if snap.family != family:
        raise SnapshotMismatch(FAMILY_MISMATCH, f"snapshot of a {snap.family} model, live model is {family}")
    if snap.fingerprint != fingerprint:
        raise SnapshotMismatch(FINGERPRINT_MISMATCH, "snapshot was taken with different weights")
    if tuple(snap.modes) != tuple(modes):
        raise SnapshotMismatch(KV_MODE_MISMATCH, f"snapshot modes {snap.modes} != live {tuple(modes)}")
    if not 0 <= length <= snap.length:
        raise SnapshotMismatch(LENGTH_OUT_OF_RANGE, f"length {length} outside 0..{snap.length}")
    check_all_restorable(caches, list(snap.layers), length)


def restore_snapshot(caches: list[LayerCache], snap: ModelSnapshot, length: int, family: str,
                     fingerprint: str, modes) -> None:
    """All-or-nothing: every check runs before any live cache is touched."""
    check_model_restore(caches, snap, length, family, fingerprint, modes)
    for cache, layer in zip(caches, snap.layers):
        cache.restore(layer, length)
