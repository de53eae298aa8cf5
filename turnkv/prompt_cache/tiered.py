"""The prompt cache with lower tiers: local disk and Redis behind memory, looked up in that order.

* ``TieredPromptCache`` is the memory store (``PromptCache``) plus lower tiers. A lookup that the
  memory store cannot answer in full asks each lower tier for an entry that beats it; a hit there
  is loaded (every object checksummed), promoted into memory and returned like a memory hit.
* Writes to lower tiers are **write-behind**: ``insert`` stores in memory and puts the snapshot
  (immutable, so safe to read from another thread) on a bounded queue that one background thread
  serializes and writes. A full queue drops the write and counts it; no request waits on a disk or
  network write.
* A session's newest entry evicted from memory (store.py's ``_evicted``) whose write-behind copy
  was never queued (the queue was full then) is queued again at eviction: it *spills* to the
  lower tiers instead of vanishing (``write_behind.spilled``).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..cache.serialize import encode
from ..cache.snapshot import ModelSnapshot
from .disk_tier import DiskTier
from .redis_tier import RedisTier
from .store import Hit, PromptCache
from .tier import DEFAULT_KEEP_TURNS, Tier, Unavailable

log = logging.getLogger("turnkv.tiers")

WRITER_NICE = 10             # the write-behind thread's nice value (Linux; see _write_loop)
DEFAULT_QUEUE = 64           # write-behind jobs waiting at most


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
        self._promoting = False
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
    def _find(self, ns, tokens):
        hit = super()._find(ns, tokens)
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
                with self._lock:
                    self._promoting = True     # already in a tier: _stored queues no write
                    try:
                        PromptCache.insert(self, ns, list(m.tokens), snap, origin=m.origin)
                    finally:
                        self._promoting = False
            except ValueError as err:
                log.warning("turnkv: %s entry not promoted: %s", tier.name, err)
            return Hit(snapshot=snap, usable=found.usable, entry_length=len(m.tokens),
                       use_logits=found.use_logits, origin=f"{tier.name}:{m.origin}")
        return hit

    # --- write-behind -----------------------------------------------------------------------------
    def _stored(self, entry) -> None:
        if self._promoting:
            entry.queued = True
        elif self.tiers and not entry.queued:
            entry.queued = self._enqueue(entry, "queued", "dropped")

    def _evicted(self, entry) -> None:
        if self.tiers and not entry.queued:
            entry.queued = self._enqueue(entry, "spilled", "spill_dropped")

    def _enqueue(self, entry, done: str, failed: str) -> bool:
        try:
            self._queue.put_nowait(_Job(entry.ns, entry.tokens, entry.snap, entry.origin))
            self._writes[done] += 1
            return True
        except queue.Full:
            self._writes[failed] += 1
            return False

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
                                 "spilled": self._writes["spilled"], "spill_dropped": self._writes["spill_dropped"],
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
        tiers.append(RedisTier(redis_url, fingerprint, int(redis_mb * 1024 * 1024), timeout_s=redis_timeout_s,
                               keep_turns=keep_turns))
    return tiers
