"""Lower tiers of the prompt cache: local disk and Redis behind memory, looked up in that order.

* ``TieredPromptCache`` is the memory store (``PromptCache``) plus lower tiers. A lookup that the
  memory store cannot answer in full asks each lower tier for an entry that beats it; a hit there
  is loaded (every object checksummed), promoted into memory and returned like a memory hit.
* Writes to lower tiers are **write-behind**: ``insert`` stores in memory and puts the snapshot
  (immutable, so safe to read from another thread) on a bounded queue that one background thread
  serializes and writes. A full queue drops the write and counts it; no request waits on a disk or
  network write.
* A tier finds entries through an index keyed by the chained hash of (namespace, tokens up to each
  64-token boundary) (cache/serialize.py): the prompt's boundaries are hashed, the deepest boundary
  with entries gives candidates, and their manifests' tokens pick the entry with the longest usable
  prefix by the memory store's own rule (``best_match``).
* Anything a tier cannot load exactly (corrupt, truncated, another format version, another model,
  a missing block) is refused with a named reason, counted, deleted, and the request prefills cold.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..cache.kv import DEFAULT_BLOCK
from ..cache.slots import common_prefix
from ..cache.serialize import (
    BLOCK_MAGIC,
    CORRUPT,
    MODEL_MISMATCH,
    Encoded,
    Manifest,
    Refused,
    chain,
    check_identity,
    decode,
    encode,
    namespace_key,
    unseal,
)
from ..cache.snapshot import ModelSnapshot
from .store import Hit, PromptCache

log = logging.getLogger("turnkv.tiers")

MAX_CANDIDATES = 32          # manifests read per index level at most
WRITER_NICE = 10             # the write-behind thread's nice value (Linux; see _write_loop)
DEFAULT_KEEP_TURNS = 1       # earlier turns of a conversation a lower tier keeps (--tier-keep-turns)
DEFAULT_QUEUE = 64           # write-behind jobs waiting at most
ORPHAN_AGE_S = 600.0         # a file without a manifest this old is a write that was cut short


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


# ------------------------------------------------------------------------------------------ disk

@dataclass
class _DiskEntry:
    manifest: Manifest
    nbytes: int                 # manifest + payload files
    blocks: list[str]
    levels: list[str]


class DiskTier(Tier):
    """Files under ``root/<model>/``: ``m/<id>`` manifests, ``p/<id>`` payloads, ``b/<xx>/<key>``
    blocks; each written to a temporary name and renamed, the manifest last, so a process killed
    mid-write leaves no entry that loads (the leftovers are removed at the next start). The index
    and the LRU order live in memory, rebuilt from the manifests at start."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, fingerprint: str, budget_bytes: int,
                 keep_turns: int = DEFAULT_KEEP_TURNS):
        super().__init__(budget_bytes, keep_turns)
        self.fingerprint = fingerprint
        self.dir = Path(root) / model_dir(fingerprint)
        for sub in ("m", "p", "b"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[str, _DiskEntry] = OrderedDict()   # least recently used first
        self._index: dict[str, dict[str, None]] = {}                   # level -> ids (insertion order)
        self._block_refs: Counter[str] = Counter()
        self._block_bytes: dict[str, int] = {}
        self._bytes = 0
        self._scan()

    # --- files ------------------------------------------------------------------------------------
    def _mpath(self, eid: str) -> Path:
        return self.dir / "m" / eid

    def _ppath(self, eid: str) -> Path:
        return self.dir / "p" / eid

    def _bpath(self, key: str) -> Path:
        return self.dir / "b" / key[:2] / key

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    @staticmethod
    def _unlink(path: Path) -> int:
        try:
            n = path.stat().st_size
            path.unlink()
            return n
        except FileNotFoundError:
            return 0

    @staticmethod
    def _abandoned(path: Path) -> bool:
        """A temporary or orphan file no live writer can still be finishing: its writer's process
        is gone (temporaries name it), or it is older than ORPHAN_AGE_S. Another server on the same
        folder may be between a block and its manifest right now."""
        parts = path.name.split(".")
        if path.name.endswith(".tmp") and len(parts) >= 4 and parts[-3].isdigit():
            pid = int(parts[-3])
            if pid != os.getpid():
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                except OSError:
                    pass
        try:
            return time.time() - path.stat().st_mtime > ORPHAN_AGE_S
        except FileNotFoundError:
            return False

    def _scan(self) -> None:
        for tmp in self.dir.rglob(".*.tmp"):
            if self._abandoned(tmp):
                self._unlink(tmp)
        paths = sorted(self._mpath("x").parent.iterdir(), key=lambda p: p.stat().st_mtime)
        for path in paths:
            eid = path.name
            try:
                m = Manifest.from_bytes(self._read(path))
                if m.id != eid:
                    raise Refused(CORRUPT, "manifest stored under another id")
                if m.data["fingerprint"] != self.fingerprint:
                    raise Refused(MODEL_MISMATCH, f"entry of {m.data['fingerprint']}")
                psize = self._ppath(eid).stat().st_size if self._ppath(eid).exists() else -1
                if psize != m.data["payload_bytes"]:
                    raise Refused(CORRUPT, "payload missing or truncated")
            except Refused as err:
                self.refusals[err.reason] += 1
                log.warning("turnkv: disk cache entry %s refused at start (%s), deleted", eid, err.reason)
                self._unlink(path)
                self._unlink(self._ppath(eid))
                continue
            self._register(m, path.stat().st_size + psize)
        for path in (self.dir / "p").iterdir():
            if path.name not in self._entries and not path.name.startswith(".") and self._abandoned(path):
                self._unlink(path)                # a payload whose manifest was never written
        for sub in (self.dir / "b").iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if path.name.startswith("."):
                    continue
                if self._block_refs[path.name] > 0:
                    size = path.stat().st_size
                    self._block_bytes[path.name] = size
                    self._bytes += size
                elif self._abandoned(path):
                    self._unlink(path)            # no manifest needs it (a write cut short)
        for eid, entry in list(self._entries.items()):
            if any(k not in self._block_bytes for k in entry.blocks):
                self.refusals["missing_block"] += 1
                self._drop(eid)
        self._evict()

    def _register(self, m: Manifest, nbytes: int) -> None:
        blocks = m.block_keys()
        levels = m.levels()
        self._entries[m.id] = _DiskEntry(m, nbytes, blocks, levels)
        for level in levels:
            self._index.setdefault(level, {})[m.id] = None
        for key in blocks:
            self._block_refs[key] += 1
        self._bytes += nbytes

    def _drop(self, eid: str, bad_blocks=()) -> None:
        entry = self._entries.pop(eid, None)
        for key in bad_blocks:
            self._bytes -= self._unlink(self._bpath(key))
            self._block_bytes.pop(key, None)
        if entry is None:
            return
        self._unlink(self._mpath(eid))
        self._unlink(self._ppath(eid))
        self._bytes -= entry.nbytes
        for level in entry.levels:
            ids = self._index.get(level)
            if ids is not None:
                ids.pop(eid, None)
                if not ids:
                    del self._index[level]
        for key in entry.blocks:
            self._block_refs[key] -= 1
            if self._block_refs[key] <= 0:
                del self._block_refs[key]
                if key in self._block_bytes:
                    self._bytes -= self._block_bytes.pop(key)
                    self._unlink(self._bpath(key))

    def _evict(self, keep: str | None = None) -> None:
        while self._bytes > self.budget_bytes and self._entries:
            victim = next(iter(self._entries))
            if victim == keep and len(self._entries) == 1:
                self.refusals["over_budget"] += 1
            self._drop(victim)
            self.counts["evictions"] += 1

    # --- the Tier interface ------------------------------------------------------------------------
    def members(self, levels):
        with self.lock:
            return [list(reversed(list(self._index.get(level, {}))))[:MAX_CANDIDATES] for level in levels]

    def manifests(self, ids):
        with self.lock:
            return {i: self._entries[i].manifest for i in ids if i in self._entries}

    def fetch(self, m, keys):
        with self.lock:
            if m.id in self._entries:
                self._entries.move_to_end(m.id)
                try:       # the LRU order a restart rebuilds (from the manifests' mtimes)
                    os.utime(self._mpath(m.id))
                except OSError:
                    pass
            payload = self._read(self._ppath(m.id))
            return payload, {k: self._read(self._bpath(k)) for k in keys}

    def put(self, enc: Encoded) -> bool:
        m = enc.manifest
        with self.lock:
            if m.id in self._entries:
                self._entries.move_to_end(m.id)
                return False
            missing = [key for key in enc.blocks if key not in self._block_bytes]
        # the files are written outside the lock: a lookup on the engine thread never waits for them
        written = {}
        for key in missing:
            data = enc.block_bytes(key)
            self._write(self._bpath(key), data)
            written[key] = len(data)
        self._write(self._ppath(m.id), enc.payload)
        self._write(self._mpath(m.id), enc.manifest_bytes)       # last: the entry exists from here on
        with self.lock:
            for key, n in written.items():
                if key not in self._block_bytes:
                    self._block_bytes[key] = n
                    self._bytes += n
            self._register(m, len(enc.payload) + len(enc.manifest_bytes))
            self.drop_subsumed(enc)
            self.drop_old_turns(enc)
            self._evict(keep=m.id)
            return True

    def delete(self, entry_id, blocks=()):
        with self.lock:
            self._drop(entry_id, blocks)

    def clear(self) -> None:
        with self.lock:
            for eid in list(self._entries):
                self._drop(eid)

    def usage(self) -> dict:
        with self.lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "blocks": len(self._block_bytes)}


# --------------------------------------------------------------------------- memory + lower tiers

@dataclass
class _Job:
    ns: object
    tokens: tuple[int, ...]
    snap: ModelSnapshot
    origin: str


class TieredPromptCache(PromptCache):
    """The memory store with lower tiers behind it (looked up in order) and a write-behind queue."""

    def __init__(self, budget_bytes: int, tiers: list[Tier], *, slack: int = 0, device="cpu",
                 queue_size: int = DEFAULT_QUEUE, **kw):
        super().__init__(budget_bytes, **kw)
        self.tiers = list(tiers)
        self.slack, self.device = slack, device
        self.family: str | None = None        # set by the engine owner when known (a model check on load)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max(1, queue_size))
        self._writes = Counter()
        self._write_ms = 0.0      # background time spent serializing and writing
        self._writer = threading.Thread(target=self._write_loop, name="turnkv-cache-writer", daemon=True)
        self._writer.start()

    def attach(self, tiers: list[Tier], family: str | None = None, device=None) -> None:
        """Add lower tiers once the model (whose fingerprint names them) is loaded. The queued
        writes are drained when the process exits normally (serve on SIGTERM, chat, generate)."""
        if tiers and not self.tiers:
            atexit.register(self.close)
        self.tiers.extend(tiers)
        if family is not None:
            self.family = family
        if device is not None:
            self.device = device

    # --- lookup -----------------------------------------------------------------------------------
    def lookup(self, ns, tokens):
        hit = super().lookup(ns, tokens)
        tokens = tuple(tokens)
        have = hit.usable if hit is not None else 0
        if not self.enabled or not self.tiers or have >= len(tokens) - 1:
            return hit
        for tier in self.tiers:
            try:
                found = tier.find(ns, tokens, have)
                snap = tier.load(found, ns, self.family, self.device) if found is not None else None
            except Unavailable:
                continue
            except Exception:       # a tier's fault costs reuse, never the request
                log.exception("turnkv: lookup in the %s cache failed", tier.name)
                with tier.lock:
                    tier.counts["errors"] += 1
                continue
            with tier.lock:
                tier.counts["hits" if snap is not None else "misses"] += 1
                if snap is not None:
                    tier.counts["tokens_reused"] += found.usable
            if snap is None:
                continue
            m = found.manifest
            try:     # promote: the next turn of this conversation is a memory hit
                PromptCache.insert(self, ns, list(m.tokens), snap, origin=m.origin)
            except ValueError as err:
                log.warning("turnkv: %s entry not promoted: %s", tier.name, err)
            return Hit(snapshot=snap, usable=found.usable, entry_length=len(m.tokens),
                       use_logits=found.use_logits, origin=f"{tier.name}:{m.origin}")
        return hit

    # --- write-behind -----------------------------------------------------------------------------
    def insert(self, ns, tokens, snap, origin="checkpoint"):
        stored = super().insert(ns, tokens, snap, origin)
        if stored and self.tiers:
            try:
                self._queue.put_nowait(_Job(ns, tuple(tokens), snap, origin))
                self._writes["queued"] += 1
            except queue.Full:
                self._writes["dropped"] += 1
        return stored

    def _write_loop(self) -> None:
        # On Linux a thread has its own nice value: the writer yields the cores to the engine's
        # threads whenever both want them (on 2 cores it otherwise adds to a turn's TTFT).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                enc = encode(job.ns, job.tokens, job.snap, job.origin, self.slack)
                for tier in self.tiers:
                    try:
                        if tier.put(enc):
                            with tier.lock:
                                tier.counts["writes"] += 1
                    except Unavailable:
                        self._writes["skipped_unavailable"] += 1
                    except Exception:          # a write fault must never reach a request
                        log.exception("turnkv: write to the %s cache failed", tier.name)
                        with tier.lock:
                            tier.counts["write_errors"] += 1
                self._writes["written"] += 1
                self._write_ms += (time.perf_counter() - t0) * 1000
            except Exception:
                log.exception("turnkv: serializing a snapshot for the lower cache tiers failed")
                self._writes["errors"] += 1
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (tests, benchmarks, shutdown). False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self.flush(timeout=30)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    # --- bookkeeping ------------------------------------------------------------------------------
    def clear(self, *args, **kw):
        """Memory as the store clears it; a full flush (no owner given) empties the lower tiers too."""
        out = super().clear(*args, **kw)
        if (args[0] if args else kw.get("owner")) is None:
            self.flush(timeout=30)
            for tier in self.tiers:
                try:
                    tier.clear()
                except Unavailable:
                    pass
        return out

    def stats(self, *args, **kw) -> dict:
        """The store's stats; the global view (no owner) adds ``tiers``, which are shared by all."""
        out = super().stats(*args, **kw)
        if (args[0] if args else kw.get("owner")) is not None:
            return out
        tiers = {t.name: t.stats() for t in self.tiers}
        tiers["write_behind"] = {"depth": self._queue.qsize(), "capacity": self._queue.maxsize,
                                 "queued": self._writes["queued"], "written": self._writes["written"],
                                 "dropped": self._writes["dropped"], "errors": self._writes["errors"],
                                 "skipped_unavailable": self._writes["skipped_unavailable"],
                                 "write_ms": round(self._write_ms, 3)}
        out["tiers"] = tiers
        return out


def build_tiers(fingerprint: str, cache_dir: str | None, disk_mb: float, redis_url: str | None,
                redis_mb: float, redis_timeout_s: float = 0.5, keep_turns: int = DEFAULT_KEEP_TURNS) -> list[Tier]:
    tiers: list[Tier] = []
    if cache_dir:
        tiers.append(DiskTier(cache_dir, fingerprint, int(disk_mb * 1024 * 1024), keep_turns=keep_turns))
    if redis_url:
        from .redis_tier import RedisTier
        tiers.append(RedisTier(redis_url, fingerprint, int(redis_mb * 1024 * 1024), timeout_s=redis_timeout_s,
                               keep_turns=keep_turns))
    return tiers
