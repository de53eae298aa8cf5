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
from .blocks import BlockPool
from .kv import KVCache
from .recurrent import StateCache
from .snapshot import ModelSnapshot, restore_snapshot, take_snapshot
from .specs import CHUNKED, SLIDING, CacheSpec, make_caches, make_pools


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

    def truncate(self, length: int) -> None:
        """Cut the live state back to its first ``length`` tokens (a rejected draft's tail:
        docs/speculative.md), and end the recurrent layers' trails, cut or not; raises
        SnapshotMismatch, touching nothing, when a layer cannot."""
        bad = next((c for c in self.caches if not c.can_truncate_to(length)), None)
        if bad is not None:
            bad.truncate(length)       # raises, naming the kind
        for c in self.caches:
            if c.offset != length or isinstance(c, StateCache):
                c.truncate(length)
        del self.tokens[length:]

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


def _proc_kib(path: str, key: str) -> int | None:
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return None


def reservable_bytes() -> int:
    """Address space the block pools may reserve in all: the machine's memory where the kernel
    overcommits (``vm.overcommit_memory`` 0 or 1: untouched pages cost nothing), and at most half
    of what an address-space limit (``ulimit -v``) leaves the process; else 0 (strict accounting
    would charge the whole reserve; unknown systems alike)."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if int(f.read()) not in (0, 1):
                return 0
        total = _proc_kib("/proc/meminfo", "MemTotal:") or 0
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            used = _proc_kib("/proc/self/status", "VmSize:") or soft
            total = min(total, max(0, soft - used) // 2)
        return total
    except (OSError, ValueError, ImportError):
        return 0


def reserve_plan(specs: list[CacheSpec], pools: list[BlockPool | None], seqs: int, max_context: int,
                 chunk: int, slack: int, cache_bytes: int, limit: int) -> list[int]:
    """Blocks to reserve per layer: ``seqs`` sequences at the most a layer keeps of a context of
    ``max_context`` (sliding and chunked layers: their window plus a prefill chunk and the slack),
    plus the prompt cache's budget as whole blocks of every layer; scaled down to ``limit`` bytes
    in all."""
    row = sum(p.block_bytes for p in pools if p is not None)
    if not row or limit <= 0:
        return [0] * len(pools)
    stored = cache_bytes // row
    plan = []
    for spec, pool in zip(specs, pools, strict=True):
        if pool is None:
            plan.append(0)
            continue
        span = max_context
        if spec.kind == SLIDING:
            span = min(span, spec.window + chunk + slack)
        elif spec.kind == CHUNKED:
            span = min(span, spec.chunk + chunk + slack)
        plan.append(seqs * (-(-span // pool.block) + 1) + stored)
    total = sum(n * p.block_bytes for n, p in zip(plan, pools) if p is not None)
    if total > limit:
        plan = [n * limit // total for n in plan]
    return plan


class StatePool:
    """Up to ``size`` slots, created on first use. With ``max_context`` (CPU only) the layers' block
    pools reserve the address space ``reserve_plan`` gives (docs/batching.md, "The pool's address
    space"), so the pools grow without copying."""

    def __init__(self, specs: list[CacheSpec], identity: StateIdentity, dtype: torch.dtype, device,
                 slack: int, size: int, max_context: int = 0, chunk: int = 0, cache_bytes: int = 0):
        if size < 1:
            raise ValueError(f"the state pool needs at least one slot, got {size}")
        self.specs, self.identity, self.dtype, self.device, self.slack = specs, identity, dtype, device, slack
        self.size = size
        self.block_pools = make_pools(specs, dtype, device, list(identity.modes))
        if max_context > 0 and torch.device(device).type == "cpu":
            plan = reserve_plan(specs, self.block_pools, size, max_context, chunk, slack, cache_bytes,
                                reservable_bytes())
            for pool, blocks in zip(self.block_pools, plan):
                if pool is not None:
                    pool.reserve(blocks)
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
        slots = list(self.slots)
        other = sum(c.nbytes for slot in slots for c in slot.caches if not isinstance(c, KVCache))
        return other + self.kv_bytes(slots)

    @staticmethod
    def kv_bytes(slots: list[SeqState]) -> int:
        """Bytes of the KV blocks ``slots`` reference, each block once however many share it."""
        held: dict[int, tuple] = {}
        for slot in slots:
            for c in slot.caches:
                if isinstance(c, KVCache):
                    held.setdefault(id(c.pool), (c.pool, set()))[1].update(c.block_ids())
        return sum(pool.block_bytes * len(ids) for pool, ids in held.values())

    def kv_capacity_bytes(self, max_context: int, chunk: int) -> int:
        """KV bytes of every slot holding a full context (windowed layers: their window), the room
        live sequences can take; the prompt cache's budget comes on top (``reserve_plan``)."""
        plan = reserve_plan(self.specs, self.block_pools, self.size, max_context, chunk, self.slack, 0, 1 << 62)
        return sum(n * p.block_bytes for n, p in zip(plan, self.block_pools) if p is not None)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the blocks the KV block pools have opened (live, stored and free ones; not the
        address space reserved beyond them)."""
        return sum(p.nbytes for p in self.block_pools if p is not None)
