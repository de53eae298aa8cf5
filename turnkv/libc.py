"""glibc, reached through ctypes: the malloc calls the launcher's tuning (launch.py) and the
model load (loading/model.py) make. None / False where the C library is not glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def libc():
    """The C library when it is glibc (it has mallopt), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (malloc_trim(3)); False where that is not glibc.
    Called once a model is loaded: the load's temporaries (a GGUF's rows before their tiles, float
    copies, file reads) are freed, but the no-trim settings (launch.py) would keep their pages resident
    for the life of the process."""
    lib = libc()
    return lib is not None and hasattr(lib, "malloc_trim") and bool(lib.malloc_trim(ctypes.c_size_t(0)))
