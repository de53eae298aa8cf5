"""PromptCache: model snapshots keyed by the tokens they hold, per namespace, under a byte budget.

* A namespace (weights fingerprint, dtype, KV-mode table, slack, tenant) never shares an entry
  with another one.
* ``lookup`` returns the entry and usable length ``u`` that maximise ``u``: a stored prefix of the
  query, or a longer / diverging entry truncated to the common prefix when every layer can be
  truncated there. ``u == len(tokens)`` only with stored logits for exactly those tokens; otherwise
  at least one token is left to prefill (its logits start the generation).
* An entry is *subsumed* by another entry of its namespace that extends its tokens, can be
  restored to every length it can (``min_restore`` no larger) and carries any logits it has.
  Such an entry adds nothing to any lookup, so it is not stored, and storing an entry removes the
  entries it subsumes. With that rule the stored set answers every lookup exactly as the set of
  everything ever inserted (less evictions) would.
* Bytes are counted once per stored part: a conversation's snapshots share their KV blocks, so its
  bytes grow with its new tokens, not with turns x length. Over budget, least recently used
  entries go first (a lookup hit counts as a use).
* Sessions survive think time: over budget, entries that a longer entry of their namespace
  extends (earlier checkpoints) go first, least recently used first; a session's newest entry (a
  *head*: nothing extends it) goes only when no such entry is left. An evicted head is handed to
  ``_evicted`` (the tiered store spills it to disk when its write-behind copy is missing).
  ``stats()["resumes"]`` counts the lookups that resume a session by where its state came from
  (sessions.py).
* Tenants: a namespace has an ``owner`` (the tenant an API key maps to; "" without keys). With a
  per-tenant budget, an owner over its share loses its own least recently used entries first, so
  one tenant's flood of unique prompts cannot evict another's conversations. ``clear`` and
  ``stats`` can be scoped to one owner.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..cache.base import DIVERGED_UNTRIMMABLE, KV_MODE_MISMATCH
from ..cache.snapshot import ModelSnapshot
from .sessions import SOURCES, SessionLedger
from .trie import RadixTrie

OVER_BUDGET = "over_budget"
ORIGINS = ("checkpoint", "prompt", "generation")


@dataclass(frozen=True)
class Namespace:
    fingerprint: str
    dtype: str
    modes: tuple[str, ...]
    slack: int
    tenant: str = ""       # the isolation key: owner and cache_salt, hashed
    owner: str = ""        # whose budget, flush and stats the entries count in

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(self.modes))  # keep it hashable if given a list

    def same_except_modes(self, other: "Namespace") -> bool:
        return (self.fingerprint, self.dtype, self.slack, self.tenant, self.owner) == (
            other.fingerprint, other.dtype, other.slack, other.tenant, other.owner) and self.modes != other.modes


@dataclass
class Hit:
    snapshot: ModelSnapshot
    usable: int            # restore to this many tokens, prefill the rest
    entry_length: int
    use_logits: bool       # usable == len(tokens): sample from snapshot.logits, prefill nothing
    origin: str = ""


@dataclass(eq=False)
class _Entry:
    ns: Namespace
    tokens: tuple[int, ...]
    snap: ModelSnapshot
    origin: str
    lo: int                # snap.min_restore(), computed once
    seq: int = field(default=0)
    queued: bool = False   # handed to the lower tiers' writer (tiered.py)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def has_logits(self) -> bool:
        return self.snap.logits is not None


def subsumes(big: _Entry, small: _Entry) -> bool:
    """``big`` answers every lookup at least as well as ``small`` (same namespace assumed)."""
    return (big.length >= small.length and big.tokens[:small.length] == small.tokens
            and big.lo <= small.lo
            and (not small.has_logits or (big.length == small.length and big.has_logits)))


@dataclass
class _Choice:
    entry: _Entry | None = None
    usable: int = 0
    use_logits: bool = False
    refused: bool = False  # an entry sharing more than ``usable`` tokens could not be truncated


def best_match(trie: RadixTrie, tokens: tuple[int, ...]) -> _Choice:
    n = len(tokens)
    best = _Choice()
    untrimmable: list[int] = []
    for c, entries in trie.walk(tokens):
        if c <= best.usable:       # groups come longest prefix first: nothing further can win
            break
        for e in entries:
            exact = c == n and e.length == n and e.has_logits
            want = min(c, n if exact else n - 1)
            if want <= best.usable:
                continue
            if e.lo <= want:       # restorable lengths are the interval [lo, length], and want <= length
                best = _Choice(e, want, exact)
            else:
                untrimmable.append(want)
    best.refused = any(w > best.usable for w in untrimmable)
    return best


COUNTERS = ("lookups", "hits", "misses", "tokens_reused", "tokens_prefilled", "evictions", "head_evictions")


class PromptCache:
    def __init__(self, budget_bytes: int, tenant_budget_bytes: int | None = None):
        if budget_bytes < 0:
            raise ValueError(f"prompt cache budget {budget_bytes} must be >= 0")
        if tenant_budget_bytes is not None and tenant_budget_bytes < 0:
            raise ValueError(f"per-tenant budget {tenant_budget_bytes} must be >= 0")
        self.budget_bytes = int(budget_bytes)
        # None: one budget for everyone (a single-tenant server)
        self.tenant_budget_bytes = None if tenant_budget_bytes is None else int(tenant_budget_bytes)
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._tries: dict[Namespace, RadixTrie] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()   # seq -> entry, least recent first
        self._owner_lru: dict[str, OrderedDict[int, _Entry]] = {}
        self._part_refs: dict[int, int] = {}                 # StoredPart uid -> entries holding it
        self._part_owner: dict[int, str] = {}                # StoredPart uid -> owner whose bytes count it
        self._owner_bytes: Counter[str] = Counter()
        self._bytes = 0
        self._counts: dict[str, Counter[str]] = {}           # owner -> COUNTERS
        self._refusals: Counter[str] = Counter()
        self._events = None        # a kv_events.BlockIndex when KV events are published (--kv-events)
        self._sessions = SessionLedger()
        self._stored_in: Counter[Namespace] = Counter()     # entries stored so far, by namespace (``version``)

    def _count(self, owner: str, name: str, n: int = 1) -> None:
        self._counts.setdefault(owner, Counter())[name] += n

    def publish_events(self, publish) -> None:
        """Announce what the cache can restore as KV events through ``publish(events)`` (called
        under the store's lock; it must not block), starting from what it holds now."""
        from .kv_events import BlockIndex
        with self._lock:
            self._events = BlockIndex(publish)
            for entry in self._lru.values():
                self._events.stored(entry.ns, entry.tokens, entry.lo)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    # --- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, tokens: list[int]) -> Hit | None:
        """The best entry for ``tokens`` (memory, then any lower tier: ``_find``); a lookup that
        resumes a session is counted by where its state came from."""
        tokens = tuple(tokens)
        hit = self._find(ns, tokens)
        if self.enabled:
            with self._lock:
                boundary = self._sessions.resumes_at(ns, tokens)
                if boundary:
                    self._count(ns.owner, "resume_" + SessionLedger.source(hit, boundary))
        return hit

    def _find(self, ns: Namespace, tokens: tuple[int, ...]) -> Hit | None:
        with self._lock:
            self._count(ns.owner, "lookups")
            choice = _Choice()
            trie = self._tries.get(ns) if self.enabled else None
            if trie is not None:
                choice = best_match(trie, tokens)
            if choice.refused:
                self._refusals[DIVERGED_UNTRIMMABLE] += 1
            if self.enabled and self._other_modes_match_longer(ns, tokens, choice.usable):
                self._refusals[KV_MODE_MISMATCH] += 1
            if choice.entry is None:
                self._count(ns.owner, "misses")
                return None
            self._count(ns.owner, "hits")
            self._count(ns.owner, "tokens_reused", choice.usable)
            e = choice.entry
            self._touch(e)
            return Hit(snapshot=e.snap, usable=choice.usable, entry_length=e.length,
                       use_logits=choice.use_logits, origin=e.origin)

    def version(self, ns: Namespace) -> int:
        """How many entries ``ns`` has had stored: while it stands, nothing new extends anything
        (a cache draft's lookup that found nothing need not be made again: engine/drafters.py)."""
        return self._stored_in[ns]

    def continuation(self, ns: Namespace, tokens: list[int]) -> tuple[int, ...] | None:
        """The tokens of the newest entry of ``ns`` (in memory) that extends ``tokens`` past their
        end, or None: what followed them in an earlier request of the namespace's tenant, which
        speculative decoding drafts from (engine/drafters.py ``CacheDrafter``). Not a use."""
        with self._lock:
            trie = self._tries.get(ns) if self.enabled else None
            longer = [e for e in trie.extensions(tokens) if e.length > len(tokens)] if trie is not None else []
            return max(longer, key=lambda e: e.seq).tokens if longer else None

    def _other_modes_match_longer(self, ns: Namespace, tokens: tuple[int, ...], usable: int) -> bool:
        return any(best_match(trie, tokens).usable > usable
                   for other, trie in self._tries.items() if ns.same_except_modes(other))

    # --- insert -------------------------------------------------------------------------------
    def insert(self, ns: Namespace, tokens: list[int], snap: ModelSnapshot, origin: str = "checkpoint") -> bool:
        """Store ``snap`` (which holds exactly ``tokens``). True when a new entry was stored; False
        when the cache is off, the entry is over the whole budget, or an existing entry subsumes it
        (that entry counts as used)."""
        tokens = tuple(tokens)
        if origin not in ORIGINS:
            raise ValueError(f"unknown snapshot origin {origin!r}; expected one of {ORIGINS}")
        if snap.length != len(tokens):
            raise ValueError(f"snapshot holds {snap.length} tokens, entry key has {len(tokens)}")
        if snap.fingerprint != ns.fingerprint or tuple(snap.modes) != ns.modes:
            raise ValueError("snapshot fingerprint / mode table does not match its namespace")
        with self._lock:
            if not self.enabled:
                return False
            if origin == "generation":
                self._sessions.turn_end(ns, tokens)
            entry = _Entry(ns, tokens, snap, origin, lo=snap.min_restore(), seq=next(self._seq))
            trie = self._tries.get(ns)
            if trie is not None:
                for old in trie.extensions(tokens):
                    if subsumes(old, entry):
                        self._touch(old)
                        return False
            if snap.nbytes > self._budget_of(ns.owner):
                self._refusals[OVER_BUDGET] += 1
                return False
            # added before the entries it subsumes go, so the blocks they share stay announced
            self._add(entry)
            if trie is not None:
                for old in trie.prefixes(tokens):
                    if old is not entry and subsumes(entry, old):
                        self._remove(old)
            owner = ns.owner
            # the owner's share first: a tenant over it loses its own oldest entries, nobody else's
            while self._owner_bytes[owner] > self._budget_of(owner):
                self._evict(self._victim(self._owner_lru[owner]))
            while self._bytes > self.budget_bytes:
                self._evict(self._victim(self._lru))
            # after the evictions: a spilled session's entry goes ahead of this one, which is in memory
            self._stored(entry)
            return True

    def _budget_of(self, owner: str) -> int:
        if self.tenant_budget_bytes is None:
            return self.budget_bytes
        return min(self.budget_bytes, self.tenant_budget_bytes)

    def _touch(self, entry: _Entry) -> None:
        self._lru.move_to_end(entry.seq)
        self._owner_lru[entry.ns.owner].move_to_end(entry.seq)

    def _is_head(self, entry: _Entry) -> bool:
        """No longer entry of its namespace extends it: a session's newest checkpoint."""
        return not any(e.length > entry.length for e in self._tries[entry.ns].extensions(entry.tokens))

    def _victim(self, lru: OrderedDict[int, _Entry]) -> _Entry:
        """The least recently used entry that is not a head, else the least recently used head."""
        for entry in lru.values():
            if not self._is_head(entry):
                return entry
        return next(iter(lru.values()))

    def _evict(self, entry: _Entry) -> None:
        head = self._is_head(entry)
        self._remove(entry)
        self._count(entry.ns.owner, "evictions")
        if head:
            self._count(entry.ns.owner, "head_evictions")
            self._evicted(entry)

    def _stored(self, entry: _Entry) -> None:
        """A new entry is in memory (the tiered store queues its write-behind copy)."""

    def _evicted(self, entry: _Entry) -> None:
        """A session's newest entry left memory (the tiered store spills it if not written)."""

    def _add(self, entry: _Entry) -> None:
        owner = entry.ns.owner
        self._stored_in[entry.ns] += 1
        self._tries.setdefault(entry.ns, RadixTrie()).insert(entry.tokens, entry)
        self._lru[entry.seq] = entry
        self._owner_lru.setdefault(owner, OrderedDict())[entry.seq] = entry
        for part in {p.uid: p for p in entry.snap.parts()}.values():
            refs = self._part_refs.get(part.uid, 0)
            if refs == 0:
                self._bytes += part.nbytes
                self._owner_bytes[owner] += part.nbytes
                self._part_owner[part.uid] = owner
            self._part_refs[part.uid] = refs + 1
        self._bytes += entry.snap.logits_nbytes
        self._owner_bytes[owner] += entry.snap.logits_nbytes
        if self._events is not None:
            self._events.stored(entry.ns, entry.tokens, entry.lo)

    def _remove(self, entry: _Entry, announce: bool = True) -> None:
        owner = entry.ns.owner
        trie = self._tries[entry.ns]
        trie.remove(entry.tokens, entry)
        if not len(trie):
            del self._tries[entry.ns]
        del self._lru[entry.seq]
        lru = self._owner_lru[owner]
        del lru[entry.seq]
        if not lru:
            del self._owner_lru[owner]
        for part in {p.uid: p for p in entry.snap.parts()}.values():
            refs = self._part_refs[part.uid] - 1
            if refs == 0:
                del self._part_refs[part.uid]
                self._bytes -= part.nbytes
                self._owner_bytes[self._part_owner.pop(part.uid)] -= part.nbytes
            else:
                self._part_refs[part.uid] = refs
        self._bytes -= entry.snap.logits_nbytes
        self._owner_bytes[owner] -= entry.snap.logits_nbytes
        if not self._owner_bytes[owner] and owner not in self._owner_lru:
            del self._owner_bytes[owner]
        if self._events is not None and announce:
            self._events.removed(entry.ns, entry.tokens, entry.lo)

    # --- bookkeeping --------------------------------------------------------------------------
    def record_prefill(self, n_tokens: int, owner: str = "") -> None:
        with self._lock:
            self._count(owner, "tokens_prefilled", int(n_tokens))

    def record_refusal(self, reason: str) -> None:
        with self._lock:
            self._refusals[reason] += 1

    def clear(self, owner: str | None = None) -> tuple[int, int]:
        """Drop every entry (``owner`` None) or one owner's; the counters keep running. Returns
        (entries removed, bytes freed)."""
        with self._lock:
            before_entries, before_bytes = len(self._lru), self._bytes
            victims = list(self._lru.values()) if owner is None else list(self._owner_lru.get(owner, {}).values())
            for entry in victims:
                self._remove(entry, announce=owner is not None)
            if owner is None and self._events is not None:
                self._events.cleared()      # one event for everything, as vLLM's reset sends
            return before_entries - len(self._lru), before_bytes - self._bytes

    def stats(self, owner: str | None = None) -> dict:
        """Everything (``owner`` None) or one owner's view: its counters, entries and bytes."""
        with self._lock:
            if owner is None:
                counts = Counter()
                for c in self._counts.values():
                    counts.update(c)
                entries, nbytes, budget = len(self._lru), self._bytes, self.budget_bytes
                namespaces = len(self._tries)
            else:
                counts = self._counts.get(owner, Counter())
                entries, nbytes = len(self._owner_lru.get(owner, ())), self._owner_bytes.get(owner, 0)
                budget = self._budget_of(owner)
                namespaces = sum(1 for ns in self._tries if ns.owner == owner)
            out = {name: counts.get(name, 0) for name in COUNTERS}
            out["resumes"] = {src: counts.get("resume_" + src, 0) for src in SOURCES}
            out.update(entries=entries, bytes=nbytes, budget_bytes=budget, namespaces=namespaces)
            if owner is None:
                out["refusals"] = dict(self._refusals)
                out["tenant_budget_bytes"] = self.tenant_budget_bytes
                out["tenants"] = {o: {"entries": len(self._owner_lru.get(o, ())), "bytes": self._owner_bytes.get(o, 0)}
                                  for o in sorted(set(self._owner_lru) | set(self._counts))}
            return out
