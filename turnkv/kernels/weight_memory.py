"""Where GGUF weights' tiles live: private anonymous mappings of their own, outside malloc, each
starting on a 2 MiB boundary.

A decode step streams every weight once, and on 4 KiB pages it pays a TLB miss every 4 KiB while
the prefetchers stop at every page end: on transparent huge pages a Llama-3.2-1B-shape Q4_K_M
decoded ~20% faster (docs/measurements/2026-12-06-load-and-kquant-decode.md). But asking for
huge pages while the load writes the tiles (glibc's huge-page heap marks its memory
MADV_HUGEPAGE at allocation) makes every 2 MiB first touch wait for the kernel to find or compact
a free huge page: on a machine whose memory was fragmented the load took 4.2 s instead of 0.8 s.
So the load writes the tiles on 4 KiB pages (no advice: a fault is only a zeroed page), and
``collapse`` moves them to huge pages afterwards (madvise MADV_COLLAPSE, Linux 6.1+: the kernel
copies each 2 MiB range into a huge page in place, the data unchanged), on a background thread
once the server answers (``collapse_in_background``). Where the kernel cannot (older kernels,
THP "never") the weights stay on 4 KiB pages and nothing else changes. Under ``serve`` those 4 KiB
pages were faulted in beforehand, beside ``import torch`` (turnkv/page_arena.py)."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref

import torch

from .. import page_arena

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25       # linux/mman.h

# the mappings ``buffer`` made and their tensors, for ``collapse`` (weak: a freed weight drops out)
_regions: "weakref.WeakKeyDictionary[torch.Tensor, tuple[int, int]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def buffer(rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] uint8 tensor in a mapping of its own whose first byte is 2 MiB aligned (its
    untouched pages cost nothing; the mapping is unmapped with the last tensor viewing it). Its
    pages come already faulted in from ``page_arena`` where ``serve`` reserved one."""
    n = rows * cols
    if n == 0 or not sys.platform.startswith("linux"):
        return torch.empty((rows, cols), dtype=torch.uint8)
    mm = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    offset = -base % HUGE
    page_arena.take(base + offset, n)       # pages faulted in ahead of the load, where serve has them
    t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset).view(rows, cols)
    with _lock:
        _regions[t] = (base + offset, n)
    return t


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


def collapse() -> int:
    """Move the whole 2 MiB ranges of every live ``buffer`` to transparent huge pages (a few
    seconds for a 1B model's weights: the kernel copies them); returns the bytes moved, 0 where
    the kernel cannot. Safe while the weights are read: the kernel swaps the pages atomically."""
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if madvise is None:
        return 0
    with _lock:
        regions = list(_regions.values())
    moved = 0
    for start, n in regions:
        length = n - n % HUGE
        if length == 0:
            continue
        if madvise(start, length, MADV_HUGEPAGE) != 0 or madvise(start, length, MADV_COLLAPSE) != 0:
            if ctypes.get_errno() in (22, 1):     # EINVAL / EPERM: no MADV_COLLAPSE here, stop asking
                return moved
            continue                               # EAGAIN / ENOMEM: this range stays on small pages
        moved += length
    return moved


def collapse_in_background() -> threading.Thread:
    """``collapse`` on a daemon thread (the call waits in the kernel without the GIL)."""
    thread = threading.Thread(target=collapse, name="turnkv-weights-to-huge-pages", daemon=True)
    thread.start()
    return thread
