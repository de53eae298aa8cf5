"""The cache contract: every per-layer state is a ``LayerCache``; its saved form is a ``LayerSnapshot``.

Rules every implementation keeps (tests in tests/test_cache_contract.py hold them to it):

* ``snapshot()`` returns an immutable object that never aliases a live buffer.
* ``restore(snap, length)`` loads a snapshot, optionally truncated to ``length <= snap.length``.
  It checks everything *before* touching live state and raises ``SnapshotMismatch(reason)``
  on a wrong kind, mode, shape, or a length the snapshot cannot be truncated to.
* ``snap.can_restore_to(t)`` is the exactness rule: a restore to ``t`` must hold what a cold
  prefill of ``t`` tokens needs for every later token.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

# Named refusal reasons, shared by caches, the prompt cache and the stats.
DIVERGED_UNTRIMMABLE = "diverged_untrimmable"
KV_MODE_MISMATCH = "kv_mode_mismatch"
FAMILY_MISMATCH = "family_mismatch"
KIND_MISMATCH = "kind_mismatch"
SHAPE_MISMATCH = "shape_mismatch"
LENGTH_OUT_OF_RANGE = "length_out_of_range"

_uids = itertools.count(1)


def new_uid() -> int:
    """A process-unique id for a stored tensor part (lets the store count shared bytes once)."""
    return next(_uids)


class SnapshotMismatch(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def tensors_nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, eq=False)
class StoredPart:
    """An immutable group of tensors that one or more snapshots reference."""

    tensors: dict[str, torch.Tensor]
    uid: int = field(default_factory=new_uid)

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.tensors.values())


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """Base snapshot. ``signature`` holds everything that must match the live cache (shape, window...)."""

    kind: ClassVar[str] = "base"
    length: int
    mode: str
    signature: tuple

    def can_restore_to(self, t: int) -> bool:
        return 0 <= t <= self.length and t >= self.length - self.max_trim

    @property
    def max_trim(self) -> int:
        """How many trailing tokens may be dropped on restore (0 = exact length only)."""
        return 0

    def parts(self) -> list[StoredPart]:
        return []

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())


class LayerCache(ABC):
    __slots__ = ()      # so KVCache's slots mean no per-object __dict__ (cache/kv.py)
    kind: ClassVar[str] = "base"
    snapshot_type: ClassVar[type[LayerSnapshot]] = LayerSnapshot

    offset: int = 0
    mode: str = "native"

    @abstractmethod
    def signature(self) -> tuple:
        """Static facts a snapshot must share with this cache (window, heads, dims, dtype)."""

    @abstractmethod
    def snapshot(self) -> LayerSnapshot: ...

    @abstractmethod
    def _load(self, snap: LayerSnapshot, length: int) -> None:
        """Load ``snap`` truncated to ``length``; all checks have passed already."""

    @abstractmethod
    def reset(self) -> None: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    def check_restore(self, snap: LayerSnapshot, length: int | None = None) -> int:
        """Validate a restore without touching state; returns the target length."""
        if snap.kind != self.kind:
            raise SnapshotMismatch(KIND_MISMATCH, f"snapshot of a {snap.kind} cache, live cache is {self.kind}")
        if snap.mode != self.mode:
            raise SnapshotMismatch(KV_MODE_MISMATCH, f"snapshot stored as {snap.mode}, live cache is {self.mode}")
        if snap.signature != self.signature():
            raise SnapshotMismatch(SHAPE_MISMATCH, f"snapshot {snap.signature} != live {self.signature()}")
        t = snap.length if length is None else int(length)
        if not 0 <= t <= snap.length:
            raise SnapshotMismatch(LENGTH_OUT_OF_RANGE, f"length {t} outside 0..{snap.length}")
        if not snap.can_restore_to(t):
            raise SnapshotMismatch(
                DIVERGED_UNTRIMMABLE, f"a {snap.kind} snapshot of {snap.length} tokens cannot be truncated to {t}"
            )
        return t

    def restore(self, snap: LayerSnapshot, length: int | None = None) -> None:
        t = self.check_restore(snap, length)
        self._load(snap, t)

    # Live truncation (no snapshot): the engine uses it when the live cache already holds the prefix.
    def can_truncate_to(self, length: int) -> bool:
        return length == self.offset

    def truncate(self, length: int) -> None:
        if length != self.offset:
            raise SnapshotMismatch(DIVERGED_UNTRIMMABLE, f"{self.kind} cache cannot be truncated live")


def check_all_restorable(caches: list[LayerCache], snaps: list[LayerSnapshot], length: int) -> None:
    """Raise the first mismatch; used before restoring any layer so a restore is all-or-nothing."""
    if len(caches) != len(snaps):
        raise SnapshotMismatch(SHAPE_MISMATCH, f"{len(snaps)} layer snapshots for {len(caches)} layers")
    for cache, snap in zip(caches, snaps):
        cache.check_restore(snap, length)
