"""Process settings the launcher applies before serving: glibc malloc tuning and CPU threads.

Why malloc matters here: glibc hands allocations above its mmap threshold (128 KiB at start,
raised dynamically up to 32 MiB) straight to ``mmap`` and trims the top of the heap back to the OS
when more than ``trim_threshold`` is free. Every prefill step allocates multi-megabyte
activations, and each fresh page then costs a page fault (slow on these VMs: "fresh memory
pages are slow"). Keeping freed memory in the heap (a high mmap threshold, no trimming, some
top padding) turns those faults into reuse of warm pages.

Two ways to apply the same settings:

- ``recommended_env()``: the environment variables (``MALLOC_*_`` + thread variables) for the
  launcher to put in a child process's environment, or to re-exec with (``reexec_with``); glibc
  reads ``MALLOC_*_`` only at process start.
- ``configure_process()``: the same malloc settings applied to the running process through
  ``mallopt(3)`` (glibc only; effective for every later allocation) plus ``torch.set_num_threads``.
  This is what ``turnkv serve|chat|generate`` and bench/throughput.py call first thing.

``turnkv serve|chat|generate`` call ``configure_process`` before loading. Measured with
bench/malloc.py (A/B in one process, medians of 4, 2026-11-29): SmolLM2 native prefill 840 ->
920 tok/s, decode 25.6 -> 26.3; Gemma 3 ``--weights auto`` prefill 902 -> 1666 tok/s (its bf16
prefill path allocates large temporaries), decode 31.2 -> 32.3.

(Checked on glibc 2.36: a 1 GiB ``MALLOC_MMAP_THRESHOLD_`` is honoured — a 100 MiB tensor then
comes from the heap, not from mmap.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

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
    return {**malloc.env(), **thread_env(threads)}


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


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
    """Re-exec the current Python command with ``env`` added, once (``marker`` stops a loop).
    For settings that must be present at process start (none of the recommended ones need it,
    since ``configure_process`` applies them live, but a launcher may prefer the env route)."""
    if os.environ.get(marker) == "1":
        return
    new_env = {**os.environ, **env, marker: "1"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new_env)


# --- engine construction from parsed CLI flags (serve, chat, generate) ---------------------------

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def sampling_from(args):
    from .engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=list(args.stop))


def tenant_budget_bytes(args) -> int | None:
    mb = getattr(args, "tenant_budget_mb", None)
    return None if mb is None else int(mb * 1024 * 1024)


def engine_from(args, progress: bool = True):
    import torch

    from .engine.engine import Engine
    from .prompt_cache.store import PromptCache
    configure_process(args.threads)
    budget = int(args.cache_budget_mb * 1024 * 1024) if args.prompt_cache else 0
    tiered = budget > 0 and bool(getattr(args, "cache_dir", None) or getattr(args, "redis_url", None))
    if tiered:
        from .prompt_cache.tiers import TieredPromptCache
        cache = TieredPromptCache(budget, [], slack=args.swa_slack, device=args.device,
                                  tenant_budget_bytes=tenant_budget_bytes(args))
    else:
        cache = PromptCache(budget, tenant_budget_bytes(args))
    engine = Engine.load(args.model, dtype=getattr(torch, DTYPES[args.dtype]), weights=args.weights,
                         progress=progress,
                         device=args.device, prompt_cache=cache, slack=args.swa_slack,
                         kv_mode=args.kv_cache_mode, kv_boundary_layers=args.kv_boundary_layers,
                         prefill_chunk=args.prefill_chunk, max_context=args.max_context,
                         **{k: getattr(args, k) for k in ("max_seqs", "max_batch_tokens", "max_queue",
                                                          "max_image_pixels", "image_cache_mb") if hasattr(args, k)})
    if tiered:   # the lower tiers are named by the loaded model's fingerprint (prompt_cache/tiers.py)
        from .prompt_cache.tiers import build_tiers
        cache.attach(build_tiers(engine.fingerprint, args.cache_dir, args.disk_cache_mb, args.redis_url,
                                 args.redis_cache_mb, args.redis_timeout_ms / 1000,
                                 keep_turns=getattr(args, "tier_keep_turns", 1)), engine.family, engine.device)
    if getattr(args, "chat_template", None) and engine.tokenizer is not None:
        from .loading.tokenizer import chat_template_source
        engine.tokenizer = engine.tokenizer.with_template(chat_template_source(args.chat_template))
    return engine


def print_banner(engine, budget_mb: float, enabled: bool) -> None:
    import torch

    from .cache.specs import describe_modes
    print(f"turnkv: {engine.name} ({engine.family}, {len(engine.specs)} layers: {engine.describe_layers()})",
          file=sys.stderr)
    print(f"turnkv: weights {engine.weights}, compute dtype {str(engine.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    if engine.weights == "gguf":
        from .kernels import kernel_info
        print(f"turnkv: GGUF kernels {kernel_info()}", file=sys.stderr)
    for note in getattr(engine.model, "weight_notes", []):
        print(f"turnkv: weights: {note}", file=sys.stderr)
    print(f"turnkv: KV mode {describe_modes(list(engine.modes), engine.specs)}; prompt cache "
          f"{'on, budget ' + format(budget_mb, 'g') + ' MiB' if enabled and budget_mb > 0 else 'off'}",
          file=sys.stderr)
    if getattr(engine, "encoder_cache", None) is not None:
        print(f"turnkv: images on (docs/images.md): encoder cache {engine.encoder_cache.budget_bytes / 2**20:g} MiB, "
              f"at most {engine.max_image_pixels} pixels an image", file=sys.stderr)
    for tier in getattr(engine.prompt_cache, "tiers", []):
        where = getattr(tier, "dir", None) or getattr(tier, "url", "")
        held = f", {tier.usage()['entries']} entries found" if tier.name == "disk" else ""
        print(f"turnkv: prompt cache tier {tier.name} at {where}, budget {tier.budget_bytes / 2**20:g} MiB{held}",
              file=sys.stderr)
