"""The disk tier of the prompt cache: entries as files under one folder per model."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..cache.serialize import CORRUPT, MODEL_MISMATCH, Encoded, Manifest, Refused
from .tier import DEFAULT_KEEP_TURNS, MAX_CANDIDATES, Tier, model_dir

log = logging.getLogger("turnkv.tiers")

ORPHAN_AGE_S = 600.0         # a file without a manifest this old is a write that was cut short


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
