"""Memory for the GGUF weights' tiles, faulted in while ``import torch`` runs (``turnkv serve``).

The load writes every tile into fresh anonymous memory (kernels/weight_memory.py ``buffer``), and
the kernel's first-touch faults (a zeroed 4 KiB page each) were ~0.17 s CPU of a 668 MB model's
repack on a 2-core Zen 2, inside the load. ``serve`` has a core to spare earlier: ``import torch``
is ~1 s of one thread holding the GIL. So before it, ``reserve`` maps one region about the size of
the model file and a thread asks the kernel to fault it in (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+, 8 MiB a call, the GIL free); ``buffer`` then moves the next faulted pages into each
weight's own mapping (``take``: ``mremap`` moves the pages, not their bytes), so each weight keeps
its mapping and lifetime. The populating stops at the first ``take`` (from then on the load needs
both cores); what the load did not take is unmapped at its end (``release``). Where none of this
is available (not Linux, an older kernel, no arena reserved) ``take`` says False and the weight's
pages fault as before; the bytes written are the same either way.

Torch-free on purpose: it runs before torch is imported."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

HUGE = 2 << 20
CHUNK = 8 << 20                      # one populate call: the lock is held this long
MADV_POPULATE_WRITE = 23             # linux/mman.h
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FAILED = ctypes.c_void_p(-1).value
SLACK = 64 << 20                     # the weights' 2 MiB-aligned starts take a little more than the file


def available_bytes() -> int | None:
    """The memory the kernel says a new process may use without swapping (MemAvailable), or None
    where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mremap.restype = ctypes.c_void_p, ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class Arena:
    """[start, end): 2 MiB-aligned anonymous memory; [taken, end) is still the arena's, the rest
    was moved out (its addresses are no longer the arena's to unmap)."""

    def __init__(self, size: int):
        self.libc = _libc()
        size = -(-size // HUGE) * HUGE
        base = self.libc.mmap(None, size + HUGE, PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap")
        self.start = base + (-base % HUGE)
        self.end = self.start + size
        if self.start > base:
            self.libc.munmap(base, self.start - base)
        if base + size + HUGE > self.end:
            self.libc.munmap(self.end, base + size + HUGE - self.end)
        self.taken = self.filled = self.start
        self.populating = True
        self.lock = threading.Lock()

    def populate(self) -> None:
        """Fault the arena in, front to back, until it is all in or ``take`` stops it."""
        while True:
            with self.lock:
                at = max(self.filled, self.taken)
                if not self.populating or at >= self.end:
                    return
                n = min(CHUNK, self.end - at)
                if self.libc.madvise(at, n, MADV_POPULATE_WRITE) != 0:
                    self.populating = False      # an older kernel (EINVAL) or no memory: the load faults them
                    return
                self.filled = at + n

    def take(self, dest: int, n: int) -> bool:
        """Move the arena's next pages (``n`` bytes' worth) to ``dest`` (page-aligned, inside a
        mapping the caller owns, which they then belong to); False where the arena has too few."""
        length = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        with self.lock:
            self.populating = False
            if self.taken + length > self.end:
                return False
            moved = self.libc.mremap(self.taken, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, dest)
            if moved != dest:       # the kernel may have unmapped dest first: map it again, empty
                self.libc.mmap(dest, length, PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_FIXED, -1, 0)
                return False
            # the next move starts 2 MiB-aligned too, as its dest does; the pages between go back
            stride = min(self.end, self.taken + -(-length // HUGE) * HUGE)
            if stride > self.taken + length:
                self.libc.munmap(self.taken + length, stride - self.taken - length)
            self.taken = stride
            return True

    def release(self) -> None:
        """Unmap what was not taken; the arena hands out nothing more."""
        with self.lock:
            self.populating = False
            if self.end > self.taken:
                self.libc.munmap(self.taken, self.end - self.taken)
            self.taken = self.end


_arena: Arena | None = None


def reserve(model, weights: str | None = None) -> threading.Thread | None:
    """For a .gguf file whose weights load as their GGUF blocks (``weights`` None or "gguf"):
    an arena of the file's size (plus ``SLACK``, at most half of MemAvailable) and a started
    daemon thread faulting it in. None where that does not apply."""
    global _arena
    if not (isinstance(model, str) and model.endswith(".gguf") and weights in (None, "gguf")
            and sys.platform.startswith("linux") and os.path.isfile(model)):
        return None
    size = os.path.getsize(model) + SLACK
    available = available_bytes()
    if available is not None:
        size = min(size, available // 2)
    try:
        _arena = Arena(size)
    except (OSError, AttributeError):
        return None
    thread = threading.Thread(target=_arena.populate, name="turnkv-page-arena", daemon=True)
    thread.start()
    return thread


def take(dest: int, n: int) -> bool:
    """``Arena.take`` of the reserved arena; False where there is none."""
    arena = _arena
    return arena is not None and arena.take(dest, n)


def held_bytes() -> int:
    """The reserved arena's faulted-in pages not yet taken: memory MemAvailable no longer counts
    that the load's tiles will have (the fit check adds it back)."""
    arena = _arena
    return 0 if arena is None else max(0, arena.filled - arena.taken)


def release() -> None:
    """The end of a load: the reserved arena's untaken memory goes back (no arena: nothing)."""
    global _arena
    arena, _arena = _arena, None
    if arena is not None:
        arena.release()
