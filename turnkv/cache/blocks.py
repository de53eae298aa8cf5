"""The per-layer KV block pool: attention K/V of every live sequence and every stored snapshot of
one layer, in fixed blocks of ``BLOCK`` positions (64; tests use smaller ones) with reference counts (docs/batching.md).

A live cache's K/V is a list of block ids (``KVCache.table``); a snapshot references the same
blocks (``BlockPart``: a block and how many of its rows it holds), so taking a snapshot, restoring
one and two live sequences sharing a prefix copy nothing but, at most, one partial block.

Two rules keep shared blocks immutable where anybody reads them:

* ``sealed[b]``: the most rows of ``b`` any snapshot part ever took. Rows below it never change.
* ``owner[b]``: the one live cache that may append rows to ``b`` (0: none). A cache writes row
  ``r`` of ``b`` only when it owns ``b`` and ``r >= sealed[b]``; otherwise it copies the rows it
  keeps into a block of its own first (copy-on-write). A live cache that holds a block it does
  not own only reads rows below its own length, which a part gave it, so below ``sealed``.

References: each live cache holds one per block in its table, each ``BlockPart`` one; the block
returns to the free list when the last goes (a part gives its reference back when it is garbage,
from whatever thread drops it, hence the lock).
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading

import torch

from .base import new_uid
from .storage import KVStore, make_store

BLOCK = 64            # positions per block: the snapshot block size and the attention kernel's key block

_cache_ids = itertools.count(1)
MADV_NOHUGEPAGE = 15          # linux/mman.h


def small_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s pages (its page-aligned inside) with 4 KiB pages, not transparent
    huge pages: a reserve written from the start of each head's region would otherwise fault in 2
    MiB per region at its first write (SmolLM2: 180 regions, 360+ MB for one short chat), and K/V
    rows read no faster from huge pages (measured, docs/batching.md). The advice stays on those
    addresses after ``t`` is freed (a later allocation there gets 4 KiB pages too; pools live as
    long as their engine). False where not applied."""
    if not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    lo, hi = (start + 4095) & ~4095, (start + t.numel() * t.element_size()) & ~4095
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(lo, hi - lo, MADV_NOHUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def new_cache_id() -> int:
    """A process-unique id for a live cache (a block's ``owner``)."""
    return next(_cache_ids)


class BlockPool:
    """One layer's blocks: a ``KVStore`` whose slots ``[b * block, (b + 1) * block)`` are block ``b``,
    grown geometrically (existing ids stay valid), with per-block references, seal and owner.

    ``reserve`` (blocks) sizes the store up front: address space only, since a CPU tensor's pages
    are faulted in on first write, so growing within it opens blocks without reallocating or
    copying the store; past it the store is reallocated and copied, geometrically. A reserved
    store is kept on 4 KiB pages, so its memory follows the blocks written (docs/batching.md,
    "The pool's address space")."""

    def __init__(self, mode: str, heads: int, head_dim: int, dtype: torch.dtype, device, block: int = BLOCK,
                 blocks: int = 0, reserve: int = 0):
        if block < 1:
            raise ValueError(f"KV block size {block} out of range")
        self.mode, self.heads, self.head_dim, self.dtype, self.block = mode, heads, head_dim, dtype, block
        self.store: KVStore = make_store(mode, heads, head_dim, dtype, device)
        self.refs: list[int] = []
        self.sealed: list[int] = []
        self.owner: list[int] = []
        self.uids: list[int] = []        # a fresh id each time a block is handed out (the budget's unit)
        self.free: list[int] = []
        self.lock = threading.RLock()
        self.block_bytes = self.store.bytes_per_token() * block
        self.reserve(reserve)
        if blocks:
            self._grow(blocks)

    def matches(self, mode: str, heads: int, head_dim: int, dtype: torch.dtype, block: int = BLOCK) -> bool:
        return (mode, heads, head_dim, dtype, block) == (self.mode, self.heads, self.head_dim, self.dtype, self.block)

    @property
    def blocks(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return len(self.refs) - len(self.free)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks opened so far (live, stored and free); a reserve's untouched rest is
        address space, not memory."""
        return len(self.refs) * self.block_bytes

    @property
    def reserved(self) -> int:
        """Blocks the store has room for without being reallocated."""
        return self.store.capacity // self.block

    def reserve(self, blocks: int) -> bool:
        """Room for ``blocks`` blocks in the store (a reallocation now, none later below it). False,
        the store as it was, when the address space is refused (an address-space limit, say): the
        pool then grows by reallocating, as it would past any reserve."""
        with self.lock:
            if blocks > self.reserved:
                try:
                    self.store.grow(blocks * self.block, keep=len(self.refs) * self.block)
                except RuntimeError:       # torch's "can't allocate memory"; the parts were not replaced
                    return False
                if self.store.device.type == "cpu":
                    for t in self.store.parts.values():
                        small_pages(t)
            return True

    def _grow(self, blocks: int) -> None:
        n = len(self.refs)
        if blocks <= n:
            return
        self.store.grow(blocks * self.block, keep=n * self.block)    # a no-op inside the reserve
        grown = blocks - n
        self.refs += [0] * grown
        self.sealed += [0] * grown
        self.owner += [0] * grown
        self.uids += [0] * grown
        self.free += range(blocks - 1, n - 1, -1)      # lowest ids first (pop from the end)

    def alloc(self, owner: int) -> int:
        """A free block (the pool grows when none is), owned by ``owner``, with one reference."""
        with self.lock:
            if not self.free:
                n = len(self.refs)
                # double; but first fill the reserve, whose blocks cost no copy
                self._grow(min(max(16, 2 * n), self.reserved) if n < self.reserved else max(16, 2 * n))
            b = self.free.pop()
            self.refs[b], self.sealed[b], self.owner[b], self.uids[b] = 1, 0, owner, new_uid()
            return b

    def incref(self, b: int) -> None:
        with self.lock:
            self.refs[b] += 1

    def release(self, b: int, holder: int = 0) -> None:
        """Drop one reference to ``b``; ``holder`` (a live cache) gives up ownership with it."""
        with self.lock:
            if holder and self.owner[b] == holder:
                self.owner[b] = 0
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.owner[b] = 0
                self.free.append(b)

    def writable(self, b: int, row: int, holder: int) -> bool:
        """Whether ``holder`` may write rows ``row ..`` of ``b`` in place (adopting it when nobody
        owns it and no part holds those rows)."""
        with self.lock:
            if self.sealed[b] > row:
                return False
            if self.owner[b] == 0:
                self.owner[b] = holder
            return self.owner[b] == holder

    def part(self, b: int, rows: int) -> "BlockPart":
        """An immutable reference to rows ``[0, rows)`` of ``b`` (seals them)."""
        with self.lock:
            self.refs[b] += 1
            self.sealed[b] = max(self.sealed[b], rows)
            uid = self.uids[b]
        return BlockPart(self, b, rows, uid)

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        B = self.block
        for t in self.store.parts.values():
            t[:, dst * B:dst * B + rows].copy_(t[:, src * B:src * B + rows])

    def view(self, b: int, a: int, n: int) -> dict[str, torch.Tensor]:
        """Rows ``[a, a + n)`` of block ``b`` as stored (views of the pool's buffers)."""
        s = b * self.block + a
        return {name: t[:, s:s + n] for name, t in self.store.parts.items()}


class BlockPart:
    """What a snapshot keeps of one block: rows ``[0, rows)`` of block ``block`` of ``pool``.

    Quacks like ``StoredPart`` (``tensors``, ``uid``, ``nbytes``) for the prompt cache and the
    tiers; ``uid`` is the block's, so parts of one block count its bytes once (a whole block: what
    it holds in memory)."""

    __slots__ = ("pool", "block", "rows", "uid", "__weakref__")

    def __init__(self, pool: BlockPool, block: int, rows: int, uid: int):
        self.pool, self.block, self.rows, self.uid = pool, block, rows, uid

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.view(self.block, 0, self.rows)

    @property
    def nbytes(self) -> int:
        return self.pool.block_bytes

    def __del__(self):
        try:
            self.pool.release(self.block)
        except Exception:          # interpreter shutdown: the pool may be gone already
            pass

