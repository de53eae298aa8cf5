"""Attention KV caches over a per-layer block pool, with snapshots that reference its blocks.

The K/V of a token at position ``p`` never changes once computed, whatever the attention kind.
So a live cache is a table of blocks of ``block_size`` positions in its layer's ``BlockPool``
(cache/blocks.py), and a snapshot is the run of those blocks it covers plus the partial last one
(``BlockPart``: a block and how many rows it holds): taking a snapshot copies nothing, a
conversation's second snapshot shares the first one's blocks, and restoring takes references
(copy-on-write for a partial block written after the restore).

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
from .blocks import BLOCK, BlockPart, BlockPool, new_cache_id
from .storage import NATIVE, dequantize_int8, payload_len, slice_payload

DEFAULT_BLOCK = BLOCK


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
    # int4 storage (``--kv-cache-mode int4``): ``stored`` holds the packed rows, ``scales`` their
    # group scales, and ``unpack(i, stored, scale)`` widens keys (0) or values (1) for other readers
    unpack: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _widen(self, i: int) -> torch.Tensor:
        if self.unpack is not None:
            return self.unpack(i, self.stored[i], self.scales[i])
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
    """Full attention: every position is kept.

    The live K/V sits in blocks of a ``BlockPool`` (cache/blocks.py), shared with the other live
    sequences of the same layer and with stored snapshots: ``table`` maps a block index (position
    // block_size) to its block id, -1 where none is held. A cache made without a pool gets one
    of its own."""

    kind: ClassVar[str] = "full"
    snapshot_type: ClassVar[type[KVSnapshot]] = KVSnapshot
    # Slots: a decode step's plan touches every live full-attention cache (8 sequences x 30 layers
    # of SmolLM2: 240 objects, cold after the step's ~300 MB of weights and K/V went through the
    # caches); an attribute in a slot sits in the object itself, not in a separate values array.
    # Paired runs of the 8-user engine: the stack's plan (cache/write.py KeptWrites.plan) 0.37-0.39
    # -> 0.27-0.29 ms a step. (Subclasses without __slots__ get a __dict__ for their own fields, as
    # before.) ``_write_rule``: cache/write.py's memo of how the native write-and-attend call writes
    # this cache.
    __slots__ = ("heads", "head_dim", "dtype", "device", "mode", "block_size", "pool", "store", "holder", "_ids",
                 "_parts", "_own", "_table", "offset", "floor", "_write_rule", "__weakref__")
    # whether the rule keeps every position (retain_from and needed_from are KVCache's own): set
    # per subclass, so one that overrides either never takes reserve's shortcut
    _keeps_all: ClassVar[bool] = True

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 mode: str = NATIVE, block_size: int = DEFAULT_BLOCK, pool: BlockPool | None = None):
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.device, self.mode, self.block_size = torch.device(device), mode, block_size
        if pool is None:
            pool = BlockPool(mode, heads, head_dim, dtype, device, block=block_size)
        elif not pool.matches(mode, heads, head_dim, dtype, block_size):
            raise ValueError("the block pool was made for another layer shape, dtype, mode or block size")
        self.pool, self.store = pool, pool.store
        self.holder = new_cache_id()
        self._ids: list[int] = []                                   # block index -> id (-1: none)
        self._parts: dict[int, BlockPart] = {}                      # block index -> its last snapshot part
        # (block index, id) of the last block checked writable: it stays so while offset only grows
        # (a part of it seals rows below offset at most, and only its owner writes it)
        self._own: tuple[int, int] = (-1, -1)
        self._table: torch.Tensor | None = None                    # the same as int32, made when asked
        self.offset = self.floor = 0

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

    # --- blocks ----------------------------------------------------------------
    @property
    def table(self) -> torch.Tensor:
        """The block table for the attention kernel: int32, block index -> block id (-1: none),
        rebuilt only after the blocks changed (once per ``block_size`` tokens of a sequence)."""
        if self._table is None:
            self._table = torch.tensor(self._ids or [-1], dtype=torch.int32)
        return self._table

    def _set(self, i: int, b: int) -> None:
        """Block index ``i`` now holds block ``b`` (-1: none); the previous one is released."""
        if i >= len(self._ids):
            self._ids += [-1] * (i + 1 - len(self._ids))
        old = self._ids[i]
        if old == b:
            return
        self._parts.pop(i, None)
        if self._own[0] == i:
            self._own = (-1, -1)
        if old >= 0:
            self.pool.release(old, self.holder)
        self._ids[i] = b
        self._table = None

    def _release_from(self, i: int, j: int | None = None) -> None:
        # last block first: the pool hands freed blocks out last-in first-out, so a sequence that
        # takes them again gets them in ascending order (runs of consecutive blocks copy and read
        # as one)
        for n in range((len(self._ids) if j is None else min(j, len(self._ids))) - 1, i - 1, -1):
            if self._ids[n] >= 0:
                self._set(n, -1)

    def reset(self) -> None:
        self._release_from(0)
        self.offset = 0
        # First position whose K/V this cache holds (a restored sliding snapshot starts later).
        self.floor = 0

    def __del__(self):
        try:
            self.reset()
        except Exception:          # interpreter shutdown
            pass

    @property
    def nbytes(self) -> int:
        return sum(1 for b in self._ids if b >= 0) * self.pool.block_bytes

    def block_ids(self) -> list[int]:
        """The ids of the blocks this cache holds, in position order."""
        return [b for b in self._ids if b >= 0]

    def _floor_block(self, pos: int) -> int:
        return (pos // self.block_size) * self.block_size

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._keeps_all = cls.retain_from is KVCache.retain_from and cls.needed_from is KVCache.needed_from

    def reserve(self, T: int) -> tuple[int, int]:
        """Take the rows of ``T`` new tokens (the caller writes their K/V there, through ``table``)
        and return ``(first_pos, q_pos0)``: the position of the first key those queries attend to,
        and the first new token's position. Blocks that leave what the layer keeps are released,
        the partial last block is made this cache's own (copy-on-write when shared) and new blocks
        are taken from the pool."""
        B, q0 = self.block_size, self.offset
        if self._keeps_all and T > 0:
            # full attention (nothing leaves, every query starts at the floor) inside the last block,
            # already this cache's own: most decode steps, once per layer and sequence
            i = q0 // B
            if q0 % B and (q0 + T - 1) // B == i and self._own[0] == i and self._own[1] == self._ids[i]:
                self.offset = q0 + T
                return self.floor, q0
        keep = self._floor_block(self.retain_from(q0))
        if keep > self.floor:
            self._release_from(0, keep // B)
            self.floor = keep
        self._own_rows(T)
        return max(self.floor, self.needed_from(q0)), q0

    def _own_rows(self, T: int) -> None:
        """Blocks for positions ``[offset, offset + T)`` that this cache may write, then move
        ``offset`` past them."""
        B, q0 = self.block_size, self.offset
        r = q0 % B
        i = q0 // B
        if T > 0 and r and (q0 + T - 1) // B == i and self._own[0] == i and self._own[1] == self._ids[i]:
            self.offset = q0 + T     # inside the last block, already this cache's own (most decode steps)
            return
        for i in range(q0 // B, (q0 + T - 1) // B + 1) if T > 0 else ():
            b = self._ids[i] if i < len(self._ids) else -1
            if i == q0 // B and r and b >= 0:
                if self._own != (i, b) and not self.pool.writable(b, r, self.holder):
                    own = self.pool.alloc(self.holder)
                    self.pool.copy_rows(b, own, r)
                    self._set(i, own)
            else:
                self._set(i, self.pool.alloc(self.holder))
            self._own = (i, self._ids[i])
        self.offset = q0 + T

    def slots(self, a: int, b: int) -> torch.Tensor:
        """The pool slots of positions ``[a, b)`` (int64)."""
        B = self.block_size
        pos = torch.arange(a, b)
        return torch.tensor(self._ids[: (b - 1) // B + 1], dtype=torch.long)[pos // B] * B + pos % B

    def _runs(self, a: int, b: int):
        """(position, slot, n) runs of consecutive slots covering positions ``[a, b)``."""
        B, pos = self.block_size, a
        while pos < b:
            i = pos // B
            j = i
            while (j + 1) * B < b and self._ids[j + 1] == self._ids[j] + 1:
                j += 1
            end = min(b, (j + 1) * B)
            yield pos, self._ids[i] * B + pos - i * B, end - pos
            pos = end

    def export(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """Positions ``[a, b)`` as stored (a copy)."""
        if a >= b:
            return {name: t[:, :0].clone() for name, t in self.store.parts.items()}
        runs = [self.store.export(s, s + n) for _, s, n in self._runs(a, b)]
        return {name: torch.cat([r[name] for r in runs], 1) for name in runs[0]} if len(runs) != 1 else runs[0]

    def _gather(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """Positions ``[a, b)`` as stored: views of the pool when their slots are consecutive."""
        runs = list(self._runs(a, b))
        if len(runs) == 1:
            s = runs[0][1]
            return {name: t[:, s:s + b - a] for name, t in self.store.parts.items()}
        idx = self.slots(a, b).to(self.device)
        return {name: t.index_select(1, idx) for name, t in self.store.parts.items()}

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of positions ``pos ..`` (reserved already) through the store's encoder."""
        for p, s, n in self._runs(pos, pos + k.shape[1]):
            self.store.write(s, k[:, p - pos:p - pos + n], v[:, p - pos:p - pos + n])

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Append K/V of ``T`` new tokens ([heads, T, head_dim]); return the keys/values those
        queries attend over, with their positions and this layer's visibility rule (``KVView``).
        The view may alias the pool's blocks: it is valid until the cache's next write."""
        first, q0 = self.reserve(k.shape[1])
        self.write(q0, k, v)
        parts = self._gather(first, self.offset)
        stored = self.store.stored_of(parts)
        if stored is not None:
            return KVView(None, None, first, q0, k.shape[1], self.kind, self.span, self.needed_from_many,
                          stored=stored, dtype=self.dtype, scales=self.store.scales_of(parts),
                          unpack=self.store.decode_side)
        keys, values = self.store.decode(parts)
        return KVView(keys, values, first, q0, k.shape[1], self.kind, self.span, self.needed_from_many)

    # --- snapshots -------------------------------------------------------------
    def snapshot(self) -> KVSnapshot:
        """References to the blocks (no copy): whole blocks, and the partial last one's rows."""
        L, B = self.offset, self.block_size
        s = max(-(-self.floor // B) * B, self._floor_block(self.retain_from(L)))
        blocks = tuple(self._part(i, B) for i in range(s // B, L // B))
        tail = self._part(L // B, L % B) if L % B and L > s else None
        return self.snapshot_type(length=L, mode=self.mode, signature=self.signature(), start=s,
                                  block_size=B, blocks=blocks, tail=tail, **self._snapshot_extra())

    def _part(self, i: int, rows: int) -> BlockPart:
        """The snapshot part of rows ``[0, rows)`` of block index ``i`` (the same object while
        they stay unchanged: a second snapshot of a cache that did not move shares its parts)."""
        part = self._parts.get(i)
        if part is None or part.rows != rows:
            part = self._parts[i] = self.pool.part(self._ids[i], rows)
        return part

    def _load(self, snap: KVSnapshot, length: int) -> None:
        """Take references to the snapshot's blocks of this pool and block size; copy any other
        part (a tier's, another pool's, another block size's) into blocks of this cache's own."""
        B, s = self.block_size, snap.start
        shared = snap.block_size == B and s % B == 0
        self._release_from(0, s // B)
        pos, i = s, s // B
        parts = list(snap.blocks) + ([snap.tail] if snap.tail is not None else [])
        self.offset = s       # writes below go through reserve's rules from here
        self.floor = s
        copies: list[tuple[int, object, int]] = []      # (own block, part, rows) to copy in
        for part in parts:
            if pos >= length:
                break
            n = min(part.rows if isinstance(part, BlockPart) else payload_len(part.tensors), length - pos)
            if shared and isinstance(part, BlockPart) and part.pool is self.pool:
                if i >= len(self._ids) or self._ids[i] != part.block:
                    self.pool.incref(part.block)
                    self._set(i, part.block)
                self.offset = pos + n
            elif shared:
                # another pool's or a tier's block: into a block of this cache's own, copied below
                own = self.pool.alloc(self.holder)
                self._set(i, own)
                copies.append((own, part, n))
                self.offset = pos + n
            else:
                payload = slice_payload(part.tensors, 0, n)
                self._load_rows(pos, payload)
            pos += n
            i = pos // B
        self._copy_in(copies)
        self._release_from(-(-length // B))
        self.offset, self.floor = length, s
        self._own = (-1, -1)

    def _copy_in(self, copies: list[tuple[int, object, int]]) -> None:
        """Copy parts' rows into their blocks. A run of consecutive own blocks (fresh blocks usually
        are) whose parts are consecutive whole blocks of one other pool is one copy; other runs
        are one concatenation per tensor (many small copies cost more in dispatch than in bytes)."""
        B, a = self.block_size, 0

        def follows(j: int) -> bool:       # copies[j] continues copies[j - 1]'s run of own blocks
            return copies[j][0] == copies[j - 1][0] + 1 and copies[j - 1][2] == B

        while a < len(copies):
            b = a + 1
            while b < len(copies) and follows(b):
                b += 1
            run = copies[a:b]
            first = run[0][1]
            rows = sum(n for _, _, n in run)
            if (isinstance(first, BlockPart) and first.pool.store.layout == self.store.layout
                    and all(isinstance(p, BlockPart) and p.pool is first.pool and p.block == first.block + k
                            for k, (_, p, _) in enumerate(run))):
                self.store.load(run[0][0] * B, first.pool.view(first.block, 0, rows))
            else:
                self.store.load_many(run[0][0] * B, [slice_payload(p.tensors, 0, n) for _, p, n in run])
            a = b

    def _load_rows(self, pos: int, payload: dict[str, torch.Tensor]) -> None:
        """Copy stored rows for positions ``pos ..`` into blocks of this cache's own."""
        n = payload_len(payload)
        self.offset = pos
        self._own_rows(n)
        done = 0
        for p, s, m in self._runs(pos, pos + n):
            self.store.load(s, slice_payload(payload, done, done + m))
            done += m

    # --- live truncation ---------------------------------------------------------
    def can_truncate_to(self, length: int) -> bool:
        return 0 <= length <= self.offset and self.floor <= self.needed_from(length)

    def truncate(self, length: int) -> None:
        if not self.can_truncate_to(length):
            super().truncate(length)
        self._release_from(-(-length // self.block_size))
        self.offset = length
        self._own = (-1, -1)
        i = length // self.block_size
        part = self._parts.get(i)
        if part is not None and part.rows > length % self.block_size:
            del self._parts[i]

