"""turnkv.launch's huge-page heap: when the tunable applies, and that a process started through
``ensure_hugepages`` really gets its malloc'd memory on transparent huge pages; and when `serve`
moves the GGUF weights to huge pages (once it answers); what `serve` does before importing torch
(torch's library mapped without the GIL, the server's libraries imported beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from turnkv import launch

ON = f"{launch.HUGETLB}=1"


def test_hugepage_env_rules():
    env = launch.hugepage_env
    assert env({}, thp="madvise", glibc=(2, 36)) == {"GLIBC_TUNABLES": ON}
    assert env({}, thp="always", glibc=(2, 35)) == {"GLIBC_TUNABLES": ON}
    # the user's other tunables are kept; the user's own choice of this one stands
    assert env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, thp="madvise", glibc=(2, 36)) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ON}"}
    assert env({"GLIBC_TUNABLES": f"{launch.HUGETLB}=0"}, thp="madvise", glibc=(2, 36)) == {}
    # off: asked to, THP never or unknown, glibc too old or not glibc
    assert env({"TURNKV_HUGEPAGES": "0"}, thp="madvise", glibc=(2, 36)) == {}
    assert env({}, thp="never", glibc=(2, 36)) == {}
    assert env({}, thp=None, glibc=(2, 36)) == {}
    assert env({}, thp="madvise", glibc=(2, 34)) == {}
    assert env({}, thp="madvise", glibc=None) == {}


# A child that starts over through ensure_hugepages, touches 64 MiB of malloc'd memory and
# prints its tunables and how much of its memory sits on huge pages.
CHILD = """
from turnkv.launch import ensure_hugepages
ensure_hugepages()
import os, torch
x = torch.ones(64 << 20, dtype=torch.uint8)
huge = 0
with open("/proc/self/smaps_rollup") as f:
    for line in f:
        if line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
print(os.environ.get("GLIBC_TUNABLES") or "-", huge, int(x.sum()) >> 20)
"""


def run_child(**env) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if k not in ("TURNKV_LAUNCH_ENV", "GLIBC_TUNABLES", "TURNKV_HUGEPAGES")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**e, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tunables, huge_kb, mib = out.stdout.split()
    assert mib == "64"
    return tunables, int(huge_kb)


@pytest.mark.skipif(not launch.hugepage_env({}), reason="no glibc >= 2.35 with THP always/madvise here")
def test_a_launched_process_gets_its_heap_on_huge_pages():
    tunables, huge_kb = run_child()
    assert ON in tunables.split(":")
    assert huge_kb >= 32 << 10            # most of the 64 MiB (2 MiB pages, the edges may not be)
    assert launch.hugepages_state({"GLIBC_TUNABLES": tunables}).startswith("malloc on transparent huge pages")
    if launch.thp_mode() == "madvise":   # off: 4 KiB pages (THP "always" would give huge pages anyway)
        tunables, huge_kb = run_child(TURNKV_HUGEPAGES="0")
        assert ON not in tunables.split(":") and huge_kb < 4 << 10
        assert launch.hugepages_state({"TURNKV_HUGEPAGES": "0"}) == "4 KiB pages (TURNKV_HUGEPAGES=0)"


def test_serve_moves_the_weights_to_huge_pages_only_once_it_answers():
    """``serve`` plans the GGUF weights' move to huge pages at the load (the banner says it) and
    starts it on a thread that waits for ``answering()``; a stop before that ends the thread
    without the move, and an engine whose banner plans none gets no thread."""
    import threading
    from types import SimpleNamespace

    from turnkv import launch
    from turnkv.kernels.weight_memory import collapse
    from turnkv.server.serve import huge_pages, once_answering

    engine = SimpleNamespace(weights="gguf")
    before = {t.name for t in threading.enumerate()}
    words = launch.weights_to_huge_pages(engine, environ={}, start=False)
    assert "turnkv-weights-to-huge-pages" not in {t.name for t in threading.enumerate()} - before
    if launch.thp_mode() in ("always", "madvise"):
        assert words.startswith("moving to 2 MiB pages")
    assert launch.weights_to_huge_pages(engine, environ={"TURNKV_HUGEPAGES": "0"}, start=False) == ""
    assert huge_pages(SimpleNamespace(weight_pages="")) is None
    assert huge_pages(SimpleNamespace(weight_pages="moving")) is collapse
    assert once_answering(lambda: True, threading.Event(), None, name="none") is None

    ran, answering, stop = [], threading.Event(), threading.Event()
    thread = once_answering(answering.is_set, stop, lambda: ran.append(1), name="job")
    thread.join(0.2)
    assert thread.is_alive() and ran == []
    answering.set()
    thread.join(5)
    assert not thread.is_alive() and ran == [1]
    stop = threading.Event()
    thread = once_answering(lambda: False, stop, lambda: ran.append(2), name="job")
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and ran == [1]


def _cached_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), by mincore(2) on a mapping."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    vec = ctypes.create_string_buffer(pages)
    try:
        assert libc.mincore(addr, size, vec) == 0
    finally:
        libc.munmap(addr, size)
    return sum(b & 1 for b in vec.raw), pages


def test_read_ahead_brings_a_gguf_file_into_the_page_cache_and_leaves_names_and_folders(tmp_path):
    """``read_ahead`` (the CLI calls it before the imports) has the kernel read a whole .gguf file
    that the page cache dropped (one advice for the whole file read only the device's
    read-ahead size, 8 MiB, on the Zen 4 VM), and starts nothing for a bundled model's name, a
    folder, a missing file or a file of another kind."""
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(32 << 20))
    fd = os.open(model, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    cached, pages = _cached_pages(model)
    if cached > pages // 2:
        pytest.skip("this file system keeps the file's pages (tmpfs?)")
    thread = launch.read_ahead(str(model))
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    deadline = time.monotonic() + 20
    while _cached_pages(model)[0] < pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cached_pages(model) == (pages, pages)
    other = tmp_path / "m.bin"
    other.write_bytes(b"x")
    for name in ("smollm2-135m", str(tmp_path), str(tmp_path / "missing.gguf"), str(other), None):
        assert launch.read_ahead(name) is None


def _probe(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_map_torch_library_maps_it_with_the_gil_free_and_torch_then_runs_on_that_mapping():
    """``map_torch_library`` (serve calls it before importing torch) maps libtorch_cpu while
    another thread keeps running Python (the GIL is free: a C call holding it would give that
    thread no turn at all), and ``import torch`` then uses the library mapped, one copy."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only: other platforms let torch map its library itself")
    found = _probe(
        "import sys, threading, time\n"
        "from turnkv.launch import map_torch_library\n"
        "seen, done = [], threading.Event()\n"
        "def spin():\n"
        "    while not done.is_set():\n"
        "        seen.append(time.perf_counter())\n"
        "thread = threading.Thread(target=spin)\n"
        "thread.start()\n"
        "time.sleep(0.05)\n"
        "start = time.perf_counter()\n"
        "mapped = map_torch_library()\n"
        "end = time.perf_counter()\n"
        "done.set()\n"
        "thread.join()\n"
        "inside = [start] + [t for t in seen if start < t < end] + [end]\n"
        "gap = max(b - a for a, b in zip(inside, inside[1:]))\n"
        "before = 'libtorch_cpu.so' in open('/proc/self/maps').read()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "files = {line.split()[-1] for line in open('/proc/self/maps') if 'libtorch_cpu.so' in line}\n"
        "print(mapped, before, end - start > 0.03, gap < (end - start) / 2, len(files), float(torch.arange(4.0).sum()))\n")
    # the other thread ran all through the call: no gap in its turns of half the call's length (a
    # C call holding the GIL leaves one as long as the call, less a switch interval: checked with
    # ctypes.PyDLL's dlopen)
    assert found == ["True", "True", "True", "True", "1", "6.0"]


def test_the_server_libraries_need_no_torch_and_load_no_shared_library_after_the_extensions():
    """What ``serve`` imports on a thread while the main thread maps torch's library: every name
    exists, none imports torch (the main thread's import then), and once ``SERVER_EXTENSIONS``
    are in they load no shared library (the dynamic loader would make that wait for torch's)."""
    found = _probe(
        "import importlib, sys\n"
        "from turnkv.server.serve import SERVER_EXTENSIONS, SERVER_LIBRARIES\n"
        "def shared():\n"
        "    return {n for n, m in list(sys.modules.items()) if str(getattr(m, '__file__', '')).endswith('.so')}\n"
        "for name in SERVER_EXTENSIONS:\n"
        "    importlib.import_module(name)\n"
        "before = shared()\n"
        "for name in SERVER_LIBRARIES:\n"
        "    importlib.import_module(name)\n"
        "print(len(SERVER_LIBRARIES), 'torch' in sys.modules, *sorted(shared() - before))\n")
    from turnkv.server.serve import SERVER_LIBRARIES

    assert found == [str(len(SERVER_LIBRARIES)), "False"]


def test_gc_paused_stops_the_collector_for_the_block_then_freezes_what_it_made():
    """``serve``'s start-up runs without the cyclic collector; after it, its objects are frozen
    (later passes skip them) and the collector is back on, also when the block raises."""
    import gc

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with launch.gc_paused():
            assert not gc.isenabled()
            made = [[] for _ in range(2000)]
            assert gc.get_count()[0] >= 2000     # no pass ran: generation 0 kept counting
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + 2000
        with pytest.raises(RuntimeError), launch.gc_paused():
            raise RuntimeError("start-up failed")
        assert gc.isenabled()
    finally:
        gc.unfreeze()
    del made
