"""The engine's live state: one KV block pool per attention layer (cache/blocks.py) and up to
``size`` per-sequence state slots, each one sequence's caches for every layer plus the tokens they
hold and the identity a snapshot of them carries.

Every slot's attention caches take their blocks from the same per-layer pools, so a snapshot, the
prompt cache's entries and any number of live sequences reference the same blocks: restoring a
full-attention prefix takes references (at most the partial last block is copied, on its first
write), whichever slot it lands in. Recurrent and conv state sit in the slots and are copied on
snapshot and restore (they are small). A slot keeps what it held when given back; ``acquire``
still prefers the free slot that shares the longest prefix with the new prompt, whose recurrent
state a restore may then not have to touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerCache
from .kv import KVCache
from .snapshot import ModelSnapshot, restore_snapshot, take_snapshot
from .specs import CacheSpec, make_caches, make_pools


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
        self.block_pools = make_pools(specs, dtype, device, list(identity.modes))
        self.slots: list[SeqState] = []
        self.free: list[SeqState] = []

    def _new(self) -> SeqState:
        caches = make_caches(self.specs, self.dtype, self.device, list(self.identity.modes), self.slack,
                             pools=self.block_pools)
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
        """Bytes the slots hold: every KV block some slot references (once, however many share
        it) and the slots' recurrent state."""
        held: dict[int, tuple] = {}
        other = 0
        for slot in list(self.slots):
            for c in slot.caches:
                if isinstance(c, KVCache):
                    held.setdefault(id(c.pool), (c.pool, set()))[1].update(c.block_ids())
                else:
                    other += c.nbytes
        return other + sum(pool.block_bytes * len(ids) for pool, ids in held.values())

    @property
    def pool_bytes(self) -> int:
        """Bytes the KV block pools have allocated (live, stored and free blocks)."""
        return sum(p.nbytes for p in self.block_pools if p is not None)
