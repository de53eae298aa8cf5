"""What every lower tier of the prompt cache (disk, Redis) shares: the lookup over its index,
loading with every object checked, counting refusals, and the pruning of entries a newer one
makes useless.

A tier finds entries through an index keyed by the chained hash of (namespace, tokens up to each
64-token boundary) (cache/serialize.py): the prompt's boundaries are hashed, the deepest boundary
with entries gives candidates, and their manifests' tokens pick the entry with the longest usable
prefix by the memory store's own rule (``best_match``). Anything a tier cannot load exactly
(corrupt, truncated, another format version, another model, a missing block) is refused with a
named reason, counted, deleted, and the request prefills cold.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..cache.kv import DEFAULT_BLOCK
from ..cache.serialize import (
    BLOCK_MAGIC,
    Encoded,
    Manifest,
    Refused,
    chain,
    check_identity,
    decode,
    namespace_key,
    unseal,
)
from ..cache.snapshot import ModelSnapshot
from ..cache.slots import common_prefix

log = logging.getLogger("turnkv.tiers")

MAX_CANDIDATES = 32          # manifests read per index level at most
DEFAULT_KEEP_TURNS = 1       # earlier turns of a conversation a lower tier keeps (--tier-keep-turns)


class Unavailable(Exception):
    """The tier cannot answer now (Redis down or slow): the caller goes on without it."""


def model_dir(fingerprint: str) -> str:
    """The folder / key-prefix name of one model's entries."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()


@dataclass
class Found:
    manifest: Manifest
    usable: int
    use_logits: bool


def subsumes(big: Manifest, small: Manifest) -> bool:
    """The store's rule (store.subsumes) on manifests of one namespace."""
    bt, st = big.tokens, small.tokens
    return (len(bt) >= len(st) and bt[:len(st)] == st and big.min_restore <= small.min_restore
            and (not small.has_logits or (len(bt) == len(st) and big.has_logits)))


class Tier:
    """What every lower tier shares: the lookup over its index, loading, counting refusals."""

    name = "tier"

    def __init__(self, budget_bytes: int, keep_turns: int = DEFAULT_KEEP_TURNS):
        if budget_bytes <= 0:
            raise ValueError(f"{self.name} cache budget must be > 0 bytes, got {budget_bytes}")
        if keep_turns < 0:
            raise ValueError(f"keep_turns must be >= 0 (0 keeps every turn), got {keep_turns}")
        self.budget_bytes = int(budget_bytes)
        self.keep_turns = int(keep_turns)
        self.counts: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.load_ms = 0.0
        self.lock = threading.RLock()

    # --- what a tier implements -----------------------------------------------------------------
    def members(self, levels: list[str]) -> list[list[str]]:
        """Entry ids registered at each index level (most recent first, at most MAX_CANDIDATES)."""
        raise NotImplementedError

    def manifests(self, ids: list[str]) -> dict[str, Manifest | Refused]:
        raise NotImplementedError

    def fetch(self, m: Manifest, keys: list[str]) -> tuple[bytes | None, dict[str, bytes | None]]:
        """The payload and the blocks of an entry (None where absent); counts as a use (LRU)."""
        raise NotImplementedError

    def put(self, enc: Encoded) -> bool:
        raise NotImplementedError

    def delete(self, entry_id: str, blocks: list[str] = ()) -> None:
        """Remove an entry (and the named blocks, known bad) from the tier."""
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def usage(self) -> dict:
        """entries and bytes as the tier counts them now."""
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------------------
    def refuse(self, entry_id: str, reason: str, blocks: list[str] = ()) -> None:
        with self.lock:
            self.refusals[reason] += 1
        log.warning("turnkv: %s cache entry %s refused (%s), deleted", self.name, entry_id, reason)
        try:
            self.delete(entry_id, blocks)
        except Unavailable:
            pass

    def find(self, ns, tokens: tuple[int, ...], beat: int) -> Found | None:
        """The entry whose usable length for ``tokens`` is largest and above ``beat``."""
        n, B = len(tokens), DEFAULT_BLOCK
        levels = chain(namespace_key(ns), tokens, B, n // B + 1)
        members = self.members(levels)
        best: Found | None = None
        seen: set[str] = set()
        for k in range(len(levels) - 1, -1, -1):
            # an entry first met at level k shares fewer than (k + 1) * B tokens with the prompt
            if max(beat, best.usable if best else 0) >= (k + 1) * B - 1:
                break
            ids = [i for i in members[k] if i not in seen]
            if not ids:
                continue
            seen.update(ids)
            for eid, m in self.manifests(ids).items():
                if isinstance(m, Refused):
                    self.refuse(eid, m.reason)
                    continue
                try:
                    check_identity(m, ns)
                except Refused as err:
                    self.refuse(eid, err.reason)
                    continue
                c = common_prefix(list(m.tokens), list(tokens))
                exact = c == n and len(m.tokens) == n and m.has_logits
                want = min(c, n if exact else n - 1)
                if want > max(beat, best.usable if best else 0) and m.min_restore <= want:
                    best = Found(m, want, exact)
        return best

    def load(self, found: Found, ns, family: str | None, device) -> ModelSnapshot | None:
        m = found.manifest
        t0 = time.perf_counter()
        keys = m.block_keys()
        payload, blocks = self.fetch(m, keys)
        try:
            check_identity(m, ns, family)
            snap = decode(m, payload, blocks, device)
        except Refused as err:
            bad = []
            for key, data in blocks.items():
                if data is not None:
                    try:
                        unseal(BLOCK_MAGIC, data)
                    except Refused:
                        bad.append(key)
            self.refuse(m.id, err.reason, bad)
            return None
        self.load_ms += (time.perf_counter() - t0) * 1000
        return snap

    def drop_subsumed(self, enc: Encoded) -> None:
        """Entries the new one answers every lookup for are removed, as the memory store does."""
        new = enc.manifest
        levels = new.levels()
        members = self.members(levels)
        ids = {i for group in members for i in group if i != new.id}
        for eid, m in self.manifests(sorted(ids)).items():
            if not isinstance(m, Refused) and m.ns_key == new.ns_key and subsumes(new, m):
                self.delete(eid)
                self.counts["subsumed"] += 1

    def drop_old_turns(self, enc: Encoded) -> None:
        """Keep the newest turns of the new entry's conversation, drop the older ones.

        A conversation's turns are marked by its end-of-generation entries: those on the new
        entry's lineage (proper prefixes of its tokens, same namespace), newest first, are the
        ends of the previous turns. Entries shorter than the ``keep_turns``-th of them are
        deleted. What stays answers the next turn, a regenerated reply and an edit of the newest
        messages; an edit further back prefills from an earlier point or cold. Without this, a
        family whose sliding windows cannot be truncated keeps every turn's windows, and the tier
        holds the whole conversation several times over (docs/tiers.md). 0 keeps everything."""
        if self.keep_turns <= 0:
            return
        new = enc.manifest
        n = len(new.tokens)
        ids = {i for group in self.members(new.levels()) for i in group if i != new.id}
        prefixes = [(eid, m) for eid, m in self.manifests(sorted(ids)).items()
                    if not isinstance(m, Refused) and m.ns_key == new.ns_key and len(m.tokens) < n
                    and new.tokens[:len(m.tokens)] == m.tokens]
        ends = sorted({len(m.tokens) for _, m in prefixes if m.origin == "generation"}, reverse=True)
        if len(ends) < self.keep_turns:
            return
        horizon = ends[self.keep_turns - 1]
        for eid, m in prefixes:
            if len(m.tokens) < horizon:
                self.delete(eid)
                self.counts["old_turns"] += 1

    def stats(self) -> dict:
        with self.lock:
            out = {"hits": self.counts["hits"], "misses": self.counts["misses"],
                   "tokens_reused": self.counts["tokens_reused"], "load_ms": round(self.load_ms, 3),
                   "writes": self.counts["writes"], "write_errors": self.counts["write_errors"],
                   "evictions": self.counts["evictions"], "subsumed": self.counts["subsumed"],
                   "old_turns": self.counts["old_turns"], "keep_turns": self.keep_turns,
                   "errors": self.counts["errors"],
                   "refusals": dict(self.refusals), "budget_bytes": self.budget_bytes}
        try:
            out.update(self.usage())
        except Unavailable:
            pass
        return out
