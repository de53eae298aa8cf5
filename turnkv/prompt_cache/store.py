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
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..cache.base import DIVERGED_UNTRIMMABLE, KV_MODE_MISMATCH
from ..cache.snapshot import ModelSnapshot
from .trie import RadixTrie

OVER_BUDGET = "over_budget"
ORIGINS = ("checkpoint", "prompt", "generation")


@dataclass(frozen=True)
class Namespace:
    fingerprint: str
    dtype: str
    modes: tuple[str, ...]
    slack: int
    tenant: str = ""

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(self.modes))  # keep it hashable if given a list

    def same_except_modes(self, other: "Namespace") -> bool:
        return (self.fingerprint, self.dtype, self.slack, self.tenant) == (
            other.fingerprint, other.dtype, other.slack, other.tenant) and self.modes != other.modes


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


class PromptCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prompt cache budget {budget_bytes} must be >= 0")
        self.budget_bytes = int(budget_bytes)
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._clear_entries()
        self._lookups = self._hits = self._misses = 0
        self._tokens_reused = self._tokens_prefilled = self._evictions = 0
        self._refusals: Counter[str] = Counter()

    def _clear_entries(self) -> None:
        self._tries: dict[Namespace, RadixTrie] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()   # seq -> entry, least recent first
        self._part_refs: dict[int, int] = {}                 # StoredPart uid -> entries holding it
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    # --- lookup -------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, tokens: list[int]) -> Hit | None:
        tokens = tuple(tokens)
        with self._lock:
            self._lookups += 1
            choice = _Choice()
            trie = self._tries.get(ns) if self.enabled else None
            if trie is not None:
                choice = best_match(trie, tokens)
            if choice.refused:
                self._refusals[DIVERGED_UNTRIMMABLE] += 1
            if self.enabled and self._other_modes_match_longer(ns, tokens, choice.usable):
                self._refusals[KV_MODE_MISMATCH] += 1
            if choice.entry is None:
                self._misses += 1
                return None
            self._hits += 1
            self._tokens_reused += choice.usable
            self._lru.move_to_end(choice.entry.seq)
            e = choice.entry
            return Hit(snapshot=e.snap, usable=choice.usable, entry_length=e.length,
                       use_logits=choice.use_logits, origin=e.origin)

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
            entry = _Entry(ns, tokens, snap, origin, lo=snap.min_restore(), seq=next(self._seq))
            trie = self._tries.get(ns)
            if trie is not None:
                for old in trie.extensions(tokens):
                    if subsumes(old, entry):
                        self._lru.move_to_end(old.seq)
                        return False
            if snap.nbytes > self.budget_bytes:
                self._refusals[OVER_BUDGET] += 1
                return False
            if trie is not None:
                for old in trie.prefixes(tokens):
                    if subsumes(entry, old):
                        self._remove(old)
            self._add(entry)
            while self._bytes > self.budget_bytes:
                victim = next(iter(self._lru.values()))
                self._remove(victim)
                self._evictions += 1
            return True

    def _add(self, entry: _Entry) -> None:
        self._tries.setdefault(entry.ns, RadixTrie()).insert(entry.tokens, entry)
        self._lru[entry.seq] = entry
        for part in {p.uid: p for p in entry.snap.parts()}.values():
            refs = self._part_refs.get(part.uid, 0)
            if refs == 0:
                self._bytes += part.nbytes
            self._part_refs[part.uid] = refs + 1
        self._bytes += entry.snap.logits_nbytes

    def _remove(self, entry: _Entry) -> None:
        trie = self._tries[entry.ns]
        trie.remove(entry.tokens, entry)
        if not len(trie):
            del self._tries[entry.ns]
        del self._lru[entry.seq]
        for part in {p.uid: p for p in entry.snap.parts()}.values():
            refs = self._part_refs[part.uid] - 1
            if refs == 0:
                del self._part_refs[part.uid]
                self._bytes -= part.nbytes
            else:
                self._part_refs[part.uid] = refs
        self._bytes -= entry.snap.logits_nbytes

    # --- bookkeeping --------------------------------------------------------------------------
    def record_prefill(self, n_tokens: int) -> None:
        with self._lock:
            self._tokens_prefilled += int(n_tokens)

    def record_refusal(self, reason: str) -> None:
        with self._lock:
            self._refusals[reason] += 1

    def clear(self) -> None:
        """Drop every entry; the counters (lookups, hits, ...) keep running."""
        with self._lock:
            self._clear_entries()

    def stats(self) -> dict:
        with self._lock:
            return {
                "lookups": self._lookups,
                "hits": self._hits,
                "misses": self._misses,
                "tokens_reused": self._tokens_reused,
                "tokens_prefilled": self._tokens_prefilled,
                "entries": len(self._lru),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
                "evictions": self._evictions,
                "refusals": dict(self._refusals),
                "namespaces": len(self._tries),
            }
