"""Attention KV caches over a linear slot buffer, with snapshots made of shared immutable blocks.

The K/V of a token at position ``p`` never changes once computed, whatever the attention kind.
So every attention snapshot is a run of immutable blocks of ``block_size`` positions plus a
partial tail, and the live cache remembers which blocks it has already frozen: a conversation's
second snapshot references the first one's blocks instead of copying them again, and a restore
skips the copy of any block the live buffer already holds.

The three attention kinds differ only in which earlier positions the next query needs
(``needed_from``) and the mask: full attention needs all of them, a sliding window the last
``window - 1``, chunked attention the start of the query's chunk. That one function gives both
the compaction rule of the live buffer and the exact truncation rule of snapshots:
a snapshot holding positions ``[start, length)`` can be restored to ``t`` iff
``t <= length and start <= needed_from(t)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .base import LayerCache, LayerSnapshot, StoredPart
from .modes import NATIVE, dequantize_int8, grown_capacity, make_store, payload_len, slice_payload

DEFAULT_BLOCK = 64


@dataclass(frozen=True, eq=False)
class KVSnapshot(LayerSnapshot):
    kind: ClassVar[str] = "full"
    start: int = 0                          # first position held (block aligned)
    block_size: int = DEFAULT_BLOCK
    blocks: tuple[StoredPart, ...] = ()     # positions [start, start + len(blocks) * block_size)
    tail: StoredPart | None = None          # the rest, up to ``length``

    def needed_from(self, t: int) -> int:
        return 0

    def can_restore_to(self, t: int) -> bool:
        return 0 <= t <= self.length and self.start <= self.needed_from(t)

    def min_restore(self) -> int:
        """The shortest length this snapshot can be restored to."""
        return 0

    @property
    def max_trim(self) -> int:
        return self.length - min(self.length, self.min_restore())

    def parts(self) -> list[StoredPart]:
        return list(self.blocks) + ([self.tail] if self.tail is not None else [])


@dataclass(frozen=True, eq=False)
class SlidingSnapshot(KVSnapshot):
    kind: ClassVar[str] = "sliding"
    window: int = 0

    def needed_from(self, t: int) -> int:
        return max(0, t - self.window + 1)

    def min_restore(self) -> int:
        return 0 if self.start == 0 else self.start + self.window - 1


@dataclass(frozen=True, eq=False)
class ChunkedSnapshot(KVSnapshot):
    kind: ClassVar[str] = "chunked"
    chunk: int = 0

    def needed_from(self, t: int) -> int:
        return (t // self.chunk) * self.chunk

    def min_restore(self) -> int:
        return -(-self.start // self.chunk) * self.chunk


def _prefill_mask(q0: int, T: int, k0: int, S: int, needed_from_many, device) -> torch.Tensor:
    """Boolean [T, S] mask (True = attend) for queries at q0.. and keys at k0..."""
    qpos = torch.arange(q0, q0 + T, device=device)[:, None]
    kpos = torch.arange(k0, k0 + S, device=device)[None, :]
    return (kpos <= qpos) & (kpos >= needed_from_many(qpos))


@dataclass(eq=False, slots=True)
class KVView:
    """What one attention call needs from a layer's cache (``update_and_fetch``'s answer).

    ``keys``/``values`` [heads, S, head_dim] hold absolute positions ``key_pos0 ..`` and the call's
    ``queries`` queries sit at ``query_pos0 ..``; a query at ``p`` sees the keys at
    ``needed_from(p) <= pos <= p``, the layer's rule: ``kind`` "full" (0), "sliding"
    (``p - span + 1``, span = window) or "chunked" (``(p // span) * span``, span = chunk). The native
    attention kernel reads the rule itself; ``mask`` (for the SDPA fallback) is built only when
    asked for."""

    _keys: torch.Tensor | None
    _values: torch.Tensor | None
    key_pos0: int
    query_pos0: int
    queries: int
    kind: str
    span: int
    needed_from_many: Callable[[torch.Tensor], torch.Tensor]   # builds the mask (SDPA fallback)
    _mask: torch.Tensor | None = None
    # float16 / bfloat16 storage (``--kv-cache-mode fp16/bf16``) as stored, without the per-call
    # conversion: the native kernel widens it exactly on load. ``keys``/``values`` convert it to
    # ``dtype`` only when somebody else asks.
    stored: tuple[torch.Tensor, torch.Tensor] | None = None
    dtype: torch.dtype | None = None
    # int8 storage (``--kv-cache-mode int8``): ``stored`` holds the int8 values and ``scales`` their
    # float16 [heads, S, 1] row scales; the native kernel reads ``q * scale`` itself
    scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def _widen(self, i: int) -> torch.Tensor:
        if self.scales is not None:
            return dequantize_int8(self.stored[i], self.scales[i], self.dtype)
        return self.stored[i].to(self.dtype)

    @property
    def keys(self) -> torch.Tensor:
        if self._keys is None:
            self._keys = self._widen(0)
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = self._widen(1)
        return self._values

    @property
    def key_count(self) -> int:
        return (self.stored[0] if self._keys is None else self._keys).shape[1]

    @property
    def mask(self) -> torch.Tensor | None:
        """Boolean [T, S] (True = attend), or None when every key is visible to every query
        (a single-token decode)."""
        if self.queries == 1:
            return None
        if self._mask is None:
            self._mask = _prefill_mask(self.query_pos0, self.queries, self.key_pos0, self.key_count,
                                       self.needed_from_many, self.keys.device)
        return self._mask


class KVCache(LayerCache):
    """Full attention: every position is kept."""

    kind: ClassVar[str] = "full"
    snapshot_type: ClassVar[type[KVSnapshot]] = KVSnapshot

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 mode: str = NATIVE, block_size: int = DEFAULT_BLOCK):
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.device, self.mode, self.block_size = torch.device(device), mode, block_size
        self.store = make_store(mode, heads, head_dim, dtype, device)
        self.reset()

    # --- kind-specific rules -------------------------------------------------
    def needed_from(self, t: int) -> int:
        """The first position a query at ``t`` attends to."""
        return 0

    def needed_from_many(self, qpos: torch.Tensor) -> torch.Tensor:
        """``needed_from`` for a tensor of query positions (builds prefill masks in one op)."""
        return torch.zeros_like(qpos)

    @property
    def span(self) -> int:
        """The rule's parameter: window (sliding), chunk (chunked), 0 (full)."""
        return 0

    def retain_from(self, pos: int) -> int:
        """The first position to keep when the next token is at ``pos`` (may be earlier than needed)."""
        return self.needed_from(pos)

    def _snapshot_extra(self) -> dict:
        return {}

    def signature(self) -> tuple:
        return (self.kind, self.heads, self.head_dim, str(self.dtype))

    # --- live state ------------------------------------------------------------
    def reset(self) -> None:
        self.offset = 0
        self.start = 0                       # position held in slot 0
        # First position whose slot holds this sequence's K/V. A restore that keeps the live slot
        # layout (to skip copying blocks the buffer already holds) leaves [start, floor) stale.
        self.floor = 0
        self._frozen: dict[int, StoredPart] = {}   # block index -> part equal to live content
        self._tail: tuple[int, StoredPart] | None = None  # (first position, part) equal to live content

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def held_parts(self) -> list[StoredPart]:
        tail = self._tail
        return list(self._frozen.values()) + ([tail[1]] if tail is not None else [])

    @property
    def used(self) -> int:
        return self.offset - self.start

    def _floor_block(self, pos: int) -> int:
        return (pos // self.block_size) * self.block_size

    def _make_room(self, T: int) -> None:
        n = self.used
        if n + T <= self.store.capacity:
            return
        new_start = max(self.start, self._floor_block(self.retain_from(self.offset)))
        drop = new_start - self.start
        if drop > 0:
            self.store.move(drop, n - drop, 0)
            self.start, n = new_start, n - drop
            self.floor = max(self.floor, new_start)
            self._frozen = {b: p for b, p in self._frozen.items() if b * self.block_size >= new_start}
            if self._tail is not None and self._tail[0] < new_start:
                self._tail = None
        if n + T > self.store.capacity:
            self.store.grow(grown_capacity(max(n + T, 2 * n), self.store.capacity), keep=n)

    def reserve(self, T: int) -> tuple[int, int, int, int]:
        """Take the slots of ``T`` new tokens (the caller writes their K/V there) and return
        ``(slot, first_slot, first_pos, q_pos0)``: the new tokens' first slot, and the slot and
        position of the first key those queries attend to, and the first new token's position."""
        self._make_room(T)
        slot, q0 = self.offset - self.start, self.offset
        self.offset += T
        first = max(self.floor, self.needed_from(q0))
        return slot, first - self.start, first, q0

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Append K/V of ``T`` new tokens ([heads, T, head_dim]); return the keys/values those
        queries attend over, with their positions and this layer's visibility rule (``KVView``)."""
        slot, a, first, q0 = self.reserve(k.shape[1])
        self.store.write(slot, k, v)
        stored = self.store.read_stored(a, self.used)
        if stored is not None:
            return KVView(None, None, first, q0, k.shape[1], self.kind, self.span, self.needed_from_many,
                          stored=stored, dtype=self.dtype, scales=self.store.read_scales(a, self.used))
        keys, values = self.store.read(a, self.used)
        return KVView(keys, values, first, q0, k.shape[1], self.kind, self.span, self.needed_from_many)

    # --- snapshots -------------------------------------------------------------
    def snapshot(self) -> KVSnapshot:
        L, B = self.offset, self.block_size
        s = max(self.floor, self._floor_block(self.retain_from(L)))
        blocks = []
        for b in range(s // B, L // B):
            part = self._frozen.get(b)
            if part is None:
                a = b * B - self.start
                part = StoredPart(self.store.export(a, a + B))
                self._frozen[b] = part
            blocks.append(part)
        tail = None
        t0 = (L // B) * B
        if L > t0:
            if self._tail is not None and self._tail[0] == t0 and payload_len(self._tail[1].tensors) == L - t0:
                tail = self._tail[1]
            else:
                tail = StoredPart(self.store.export(t0 - self.start, L - self.start))
                self._tail = (t0, tail)
        return self.snapshot_type(length=L, mode=self.mode, signature=self.signature(), start=s,
                                  block_size=B, blocks=tuple(blocks), tail=tail, **self._snapshot_extra())

    def _keeps_layout(self, snap: KVSnapshot, length: int) -> bool:
        """Whether a restore can leave the live slots where they are (and skip the blocks they
        already hold): same blocks, and the live buffer starts at or before the snapshot without
        having to grow to reach ``length``."""
        if snap.block_size != self.block_size or self.store.capacity == 0:
            return False
        return snap.start == self.start or (self.start < snap.start and length - self.start <= self.store.capacity)

    def _load(self, snap: KVSnapshot, length: int) -> None:
        B, s = snap.block_size, snap.start
        same_layout = self._keeps_layout(snap, length)
        base = self.start if same_layout else s      # position that slot 0 will hold
        if self.store.capacity < length - base:
            keep = self.used if same_layout else 0
            self.store.grow(grown_capacity(length - base, self.store.capacity), keep=keep)
        frozen: dict[int, StoredPart] = {}
        pos = s
        for part in snap.blocks:
            if pos >= length:
                break
            b = pos // B
            n = min(B, length - pos)
            live_has = (same_layout and self._frozen.get(b) is part and pos + B <= self.offset)
            if not live_has:
                self.store.load(pos - base, slice_payload(part.tensors, 0, n) if n < B else part.tensors)
            if n == B:
                frozen[b] = part
            pos += B
        tail_state = None
        if snap.tail is not None and pos < length:
            n = length - pos
            tail_len = payload_len(snap.tail.tensors)
            live_has = (same_layout and self._tail is not None and self._tail[0] == pos
                        and self._tail[1] is snap.tail and pos + tail_len <= self.offset)
            if not live_has:
                self.store.load(pos - base, slice_payload(snap.tail.tensors, 0, n))
            if n == tail_len:
                tail_state = (pos, snap.tail)
        # A snapshot made with another block size brings its block layout with it (``s`` and the
        # frozen block indices are in its units).
        self.block_size = B
        self.start, self.floor, self.offset = base, s, length
        self._frozen, self._tail = frozen, tail_state

    # --- live truncation ---------------------------------------------------------
    def can_truncate_to(self, length: int) -> bool:
        return 0 <= length <= self.offset and self.floor <= self.needed_from(length)

    def truncate(self, length: int) -> None:
        if not self.can_truncate_to(length):
            super().truncate(length)
        self.offset = length
        B = self.block_size
        self._frozen = {b: p for b, p in self._frozen.items() if (b + 1) * B <= length}
        if self._tail is not None and self._tail[0] + payload_len(self._tail[1].tensors) > length:
            self._tail = None
