"""Process settings the launcher applies before serving: glibc malloc tuning and CPU threads.

Why malloc matters here: glibc hands allocations above its mmap threshold (128 KiB at start,
raised dynamically up to 32 MiB) straight to ``mmap`` and trims the top of the heap back to the OS
when more than ``trim_threshold`` is free. Every prefill step allocates multi-megabyte
activations, and each fresh page then costs a page fault (slow on these VMs: "fresh memory
pages are slow"). Keeping freed memory in the heap (a high mmap threshold, no trimming, some
top padding) turns those faults into reuse of warm pages.

Two ways to apply the same settings:

- ``recommended_env()``: the environment variables (``MALLOC_*_``, thread variables and the
  huge-page tunable below) for the launcher to put in a child process's environment; glibc reads
  them only at process start.
- ``configure_process()``: the same malloc settings applied to the running process through
  ``mallopt(3)`` (glibc only; effective for every later allocation) plus ``torch.set_num_threads``.
  This is what ``turnkv serve|chat|generate`` and bench/throughput.py call first thing.

One setting has no live route: glibc's transparent-huge-page heap (``GLIBC_TUNABLES=
glibc.malloc.hugetlb=1``, read at start only). ``turnkv serve|chat|generate`` (and the speed
benches) re-exec themselves once with it (``ensure_hugepages``); see the section below.

``turnkv serve|chat|generate`` call ``configure_process`` before loading. Measured with
bench/malloc.py (A/B in one process, medians of 4, 2026-11-29): SmolLM2 native prefill 840 ->
920 tok/s, decode 25.6 -> 26.3; Gemma 3 ``--weights auto`` prefill 902 -> 1666 tok/s (its bf16
prefill path allocates large temporaries), decode 31.2 -> 32.3.

(Checked on glibc 2.36: a 1 GiB ``MALLOC_MMAP_THRESHOLD_`` is honoured — a 100 MiB tensor then
comes from the heap, not from mmap.)
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from .libc import libc as _libc

MiB = 1 << 20

# mallopt(3) parameter numbers (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@dataclass(frozen=True)
class MallocSettings:
    mmap_threshold: int = 32 * MiB     # allocations below this come from the (reused) heap
    trim_threshold: int = 1 << 31      # never give freed heap memory back to the OS mid-run
    top_pad: int = 256 * MiB           # grow the heap in large steps (fewer brk calls)

    def env(self) -> dict[str, str]:
        return {
            "MALLOC_MMAP_THRESHOLD_": str(self.mmap_threshold),
            "MALLOC_TRIM_THRESHOLD_": str(self.trim_threshold),
            "MALLOC_TOP_PAD_": str(self.top_pad),
        }


RECOMMENDED_MALLOC = MallocSettings()


def physical_cores() -> int:
    """CPUs this process may run on (containers/VMs here expose one thread per core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_env(threads: int | None = None) -> dict[str, str]:
    """One compute thread per core for OpenMP (torch intra-op) and MKL."""
    n = str(threads or physical_cores())
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def recommended_env(threads: int | None = None, malloc: MallocSettings = RECOMMENDED_MALLOC) -> dict[str, str]:
    """Environment variables a launcher should set for a turnkv process."""
    return {**malloc.env(), **thread_env(threads), **hugepage_env()}


def apply_malloc(settings: MallocSettings = RECOMMENDED_MALLOC) -> bool:
    """Apply ``settings`` to this process with mallopt(3). False where that is not glibc malloc
    or a value was rejected."""
    libc = _libc()
    if libc is None:
        return False
    ok = True
    for param, value in ((_M_MMAP_THRESHOLD, settings.mmap_threshold),
                         (_M_TRIM_THRESHOLD, settings.trim_threshold),
                         (_M_TOP_PAD, settings.top_pad)):
        ok &= bool(libc.mallopt(ctypes.c_int(param), ctypes.c_int(min(value, 2**31 - 1))))
    return ok


@dataclass(frozen=True)
class ProcessSettings:
    threads: int
    malloc_applied: bool


def configure_process(threads: int | None = None, malloc: MallocSettings | None = RECOMMENDED_MALLOC) -> ProcessSettings:
    """Tune the running process: malloc (``None`` leaves it alone) and torch's intra-op threads."""
    import torch

    n = threads or physical_cores()
    torch.set_num_threads(n)
    applied = apply_malloc(malloc) if malloc is not None else False
    return ProcessSettings(threads=n, malloc_applied=applied)


def reexec_with(env: dict[str, str], marker: str = "TURNKV_LAUNCH_ENV") -> None:
    """Re-exec the current Python command with ``env`` added, once (``marker`` stops a loop):
    for settings glibc reads only at process start (``ensure_hugepages``)."""
    if os.environ.get(marker) == "1":
        return
    new_env = {**os.environ, **env, marker: "1"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new_env)


# --- transparent huge pages for malloc'd memory --------------------------------------------------
# A decode step streams every weight (~100 MB for SmolLM2, more for larger models) once, through
# 4 KiB pages by default: a TLB miss every 4 KiB, and the hardware prefetchers stop at each page's
# end. glibc >= 2.35 backs the memory malloc takes from the system
# (its heap and its mmap'd chunks) with transparent huge pages when GLIBC_TUNABLES holds
# glibc.malloc.hugetlb=1 (madvise(MADV_HUGEPAGE): works with the kernel's THP setting "madvise",
# the common default, as well as "always"). glibc reads it at process start only, so ``turnkv
# serve|chat|generate`` re-exec themselves once with it (``ensure_hugepages``). Measured on a
# Zen 4 VM (docs/kernels.md): SmolLM2 decode steps 4.8-5.3 -> 4.4-4.6 ms (one sequence), 15.8 ->
# 13.6 ms (8 sequences); RSS +25-30 MB. TURNKV_HUGEPAGES=0 turns it off. (The K/V pools' reserved
# stores opt out, MADV_NOHUGEPAGE: cache/blocks.py ``small_pages``.)
HUGETLB = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never), None where unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def _hugepages_refused(environ) -> bool:
    """TURNKV_HUGEPAGES=0: the user keeps 4 KiB pages."""
    return environ.get("TURNKV_HUGEPAGES", "1").strip() == "0"


def hugepage_env(environ=None, thp: str | None = "probe", glibc: tuple[int, int] | None | str = "probe") -> dict[str, str]:
    """The GLIBC_TUNABLES that turns glibc's huge-page heap on, added to what ``environ`` holds;
    {} where it does not apply: TURNKV_HUGEPAGES=0, not glibc >= 2.35, THP "never" or absent,
    or GLIBC_TUNABLES names the tunable already (the user's choice, on or off, stands)."""
    environ = os.environ if environ is None else environ
    thp = thp_mode() if thp == "probe" else thp
    glibc = glibc_version() if glibc == "probe" else glibc
    if _hugepages_refused(environ) or glibc is None or glibc < (2, 35):
        return {}
    if thp not in ("always", "madvise"):
        return {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    if HUGETLB + "=" in tunables:
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{HUGETLB}=1" if tunables else f"{HUGETLB}=1"}


def ensure_hugepages() -> None:
    """Re-exec this command once with glibc's huge-page heap on, where ``hugepage_env`` applies
    (call it first thing: the process starts over)."""
    env = hugepage_env()
    if env:
        reexec_with(env)


READ_AHEAD_CHUNK = 1 << 20     # under the usual devices' read-ahead and request sizes


def read_ahead(model) -> "threading.Thread | None":
    """A started daemon thread asking the kernel to read ``model`` (a .gguf file; None for a
    bundled name or a folder) into the page cache (posix_fadvise WILLNEED, without the GIL),
    so the disk reads of a file the page cache does not hold (the first start after a download
    or a reboot, or a file evicted since) overlap the ~1 s of imports before the load instead of
    following them. Where the file is cached already it costs a walk over its cached pages.
    One advice a ``READ_AHEAD_CHUNK``: the kernel reads at most the device's read-ahead size of
    one (8 MiB of a 64 MiB file on the Zen 4 VM's disk)."""
    if not (isinstance(model, str) and model.endswith(".gguf") and hasattr(os, "posix_fadvise")
            and os.path.isfile(model)):
        return None
    import threading

    def advise() -> None:
        try:
            fd = os.open(model, os.O_RDONLY)
        except OSError:
            return                     # the load says why it cannot open the file
        try:
            for offset in range(0, os.fstat(fd).st_size, READ_AHEAD_CHUNK):
                os.posix_fadvise(fd, offset, READ_AHEAD_CHUNK, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    thread = threading.Thread(target=advise, name="turnkv-read-ahead", daemon=True)
    thread.start()
    return thread


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (a start-up: imports and the load), its
    objects then moved out of the collector's sight (``gc.freeze``: later passes skip them) and
    the collector back on. A ``serve`` start creates ~320k tracked objects, nearly all kept for
    the process's life; with the collector on, its ~460 passes over them (3 full) took 0.17 s of
    GIL-held CPU of a 1B GGUF's start on a 2-core Zen 2. The garbage among them is small (a full
    pass at the end of that start found ~8k objects, none a tensor or a mapping) and stays."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def map_torch_library() -> bool:
    """Map torch's C++ library (libtorch_cpu and what it links: ~0.2 s CPU of relocations and
    static constructors on a 2-core Zen 2) through dlopen called with ctypes, which leaves the GIL
    free meanwhile, so a thread importing Python modules runs beside it; ``import torch`` then
    finds it mapped. The flags are those Python loads extension modules with (RTLD_NOW, symbols
    local), as the library gets as the dependency of torch's ``_C``. False where there is no such
    file (another platform or layout): torch maps it itself, as before."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations or not sys.platform.startswith("linux"):
        return False
    path = os.path.join(spec.submodule_search_locations[0], "lib", "libtorch_cpu.so")
    if not os.path.isfile(path):
        return False
    dlopen = ctypes.CDLL(None).dlopen
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    return bool(dlopen(os.fsencode(path), os.RTLD_NOW))


def hugepages_state(environ=None) -> str:
    """What the banner says: whether this process runs with glibc's huge-page heap, or why not."""
    environ = os.environ if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    mode = thp_mode()
    if f"{HUGETLB}=1" in tunables and mode in ("always", "madvise"):
        return f"malloc on transparent huge pages ({HUGETLB}=1, THP {mode})"
    if mode == "always":
        return "transparent huge pages (THP always)"
    if _hugepages_refused(environ):
        why = "TURNKV_HUGEPAGES=0"
    elif mode != "madvise":
        why = f"THP {mode or 'unavailable'}"
    elif (glibc_version() or (0, 0)) < (2, 35):
        why = f"{HUGETLB} needs glibc >= 2.35"
    else:
        why = f"the process did not start with {HUGETLB}=1"
    return f"4 KiB pages ({why})"


# --- engine construction from parsed CLI flags (serve, chat, generate) ---------------------------

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def sampling_from(args):
    from .engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=list(args.stop))


def tenant_budget_bytes(args) -> int | None:
    mb = getattr(args, "tenant_budget_mb", None)
    return None if mb is None else int(mb * 1024 * 1024)


def engine_from(args, progress: bool = True, huge_pages_now: bool = True):
    """``huge_pages_now`` False: the GGUF weights' move to huge pages is left for the caller to
    start (``serve`` starts it once the server answers)."""
    import torch

    from .engine.engine import Engine
    from .prompt_cache.store import PromptCache
    configure_process(args.threads)
    budget = int(args.cache_budget_mb * 1024 * 1024) if args.prompt_cache else 0
    tiered = budget > 0 and bool(getattr(args, "cache_dir", None) or getattr(args, "redis_url", None))
    if tiered:
        from .prompt_cache.tiered import TieredPromptCache
        cache = TieredPromptCache(budget, [], slack=args.swa_slack, device=args.device,
                                  tenant_budget_bytes=tenant_budget_bytes(args))
    else:
        cache = PromptCache(budget, tenant_budget_bytes(args))
    mmproj = False if getattr(args, "no_mmproj", False) else getattr(args, "mmproj", None)
    engine = Engine.load(args.model, dtype=getattr(torch, DTYPES[args.dtype]), weights=args.weights,
                         progress=progress, mmproj=mmproj,
                         device=args.device, prompt_cache=cache, slack=args.swa_slack,
                         kv_mode=args.kv_cache_mode, kv_boundary_layers=args.kv_boundary_layers,
                         prefill_chunk=args.prefill_chunk, max_context=args.max_context,
                         speculative=args.speculative, draft_max=args.draft_max,
                         adaptive_threads=getattr(args, "adaptive_threads", "off") == "on",
                         **{k: getattr(args, k) for k in ("max_seqs", "max_batch_tokens", "max_queue",
                                                          "max_image_pixels", "image_cache_mb") if hasattr(args, k)})
    engine.weight_pages = weights_to_huge_pages(engine, start=huge_pages_now)
    if args.speculative == "auto":      # its check runs when the engine is idle: no request waits for it
        engine.idle_check = lambda: True
    if tiered:   # the lower tiers are named by the loaded model's fingerprint (prompt_cache/tiered.py)
        from .prompt_cache.tiered import build_tiers
        cache.attach(build_tiers(engine.fingerprint, args.cache_dir, args.disk_cache_mb, args.redis_url,
                                 args.redis_cache_mb, args.redis_timeout_ms / 1000,
                                 keep_turns=getattr(args, "tier_keep_turns", 1)), engine.family, engine.device)
    if getattr(args, "kv_events", None):
        from .prompt_cache.kv_events import ZmqPublisher
        publisher = ZmqPublisher(args.kv_events)
        cache.publish_events(publisher.publish)
        print(f"turnkv: KV events on {publisher.endpoint} (vLLM's schema, docs/scale-out.md)", file=sys.stderr)
    if getattr(args, "chat_template", None) and engine.tokenizer is not None:
        from .loading.tokenizer import chat_template_source
        engine.tokenizer = engine.tokenizer.with_template(chat_template_source(args.chat_template),
                                                          note=f"{args.chat_template} (--chat-template)")
    return engine


def weights_to_huge_pages(engine, environ=None, start: bool = True) -> str:
    """GGUF weights move to transparent huge pages on a background thread once loaded
    (kernels/weight_memory.py), unless TURNKV_HUGEPAGES=0 or the kernel's THP is off; the
    banner's words for it, "" when nothing moves. ``start`` False: the move is only planned, and
    the caller starts ``collapse_in_background`` when the words are not ""."""
    environ = os.environ if environ is None else environ
    if engine.weights != "gguf" or _hugepages_refused(environ) or thp_mode() not in ("always", "madvise"):
        return ""
    if start:
        from .kernels.weight_memory import collapse_in_background
        collapse_in_background()
    return "moving to 2 MiB pages in the background (MADV_COLLAPSE, Linux 6.1+)"


def thread_note(engine) -> str:
    """The banner's words on the thread count: adaptive (engine/threads.py) or not."""
    governor = getattr(engine, "threads", None)
    if governor is None:
        return ""
    return " (fewer while that is faster: --adaptive-threads, docs/threads.md)"


def print_banner(engine, budget_mb: float, enabled: bool) -> None:
    import torch

    from .cache.specs import describe_modes
    print(f"turnkv: {engine.name} ({engine.family}, {len(engine.specs)} layers: {engine.describe_layers()})",
          file=sys.stderr)
    print(f"turnkv: weights {engine.weights}, compute dtype {str(engine.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads{thread_note(engine)}, {hugepages_state()}", file=sys.stderr)
    if engine.weights == "gguf":    # per type: the kernel that runs it, or that it is a float copy
        from .kernels import kernel_info
        print(f"turnkv: GGUF kernels: {getattr(engine.model, 'gguf_types', None) or kernel_info()}", file=sys.stderr)
        if getattr(engine, "weight_pages", ""):
            print(f"turnkv: GGUF weights {engine.weight_pages}", file=sys.stderr)
    for note in getattr(engine.model, "weight_notes", []):
        print(f"turnkv: weights: {note}", file=sys.stderr)
    if getattr(engine.tokenizer, "template_note", ""):
        print(f"turnkv: chat template {engine.tokenizer.template_note}", file=sys.stderr)
    print(f"turnkv: KV mode {describe_modes(list(engine.modes), engine.specs)}; prompt cache "
          f"{'on, budget ' + format(budget_mb, 'g') + ' MiB' if enabled and budget_mb > 0 else 'off'}",
          file=sys.stderr)
    if engine.speculative == "auto":    # its check runs in the engine's first idle moment (Engine.run)
        print(f"turnkv: speculative auto (the cache's drafts, else ngram's), drafts of up to {engine.draft_max} "
              "tokens once a check on this model has passed", file=sys.stderr)
    elif engine.speculative != "off":     # the probe runs here, on the thread that runs the engine
        blocked = engine.speculation_blocked()
        print(f"turnkv: speculative {engine.speculative}, drafts of up to {engine.draft_max} tokens"
              if not blocked else f"turnkv: speculative decoding off for this model ({blocked}; docs/speculative.md)",
              file=sys.stderr)
    if getattr(engine, "encoder_cache", None) is not None:
        source = getattr(engine.model, "image_source", None)
        print(f"turnkv: images on (docs/images.md): encoder cache {engine.encoder_cache.budget_bytes / 2**20:g} MiB, "
              f"at most {engine.max_image_pixels} pixels an image"
              + (f"; vision tower and preprocessing from {source}" if source else ""), file=sys.stderr)
    for tier in getattr(engine.prompt_cache, "tiers", []):
        where = getattr(tier, "dir", None) or getattr(tier, "url", "")
        held = f", {tier.usage()['entries']} entries found" if tier.name == "disk" else ""
        print(f"turnkv: prompt cache tier {tier.name} at {where}, budget {tier.budget_bytes / 2**20:g} MiB{held}",
              file=sys.stderr)
