"""Snapshot and restore cost against a plain memcpy of the same bytes.

For each bundled model, the live caches (their blocks in per-layer KV block pools, as the engine
has them) are filled with N tokens of K/V (random values: the cost does not depend on them), then
timed, median of several repetitions:

- memcpy:              one ``copy_`` of a buffer holding the same number of bytes;
- snapshot:            ``take_snapshot`` (references to the pool's blocks: no copy);
- restore (pool):      ``restore_snapshot`` into other caches of the same pools (references; the
                       engine's case: any slot, any live sequence sharing the prefix);
- restore (copy):      into caches with pools of their own (copies everything: a snapshot from a
                       disk or Redis tier, or another engine's);
- snapshot (+64):      a snapshot after 64 more tokens.

    python bench/snapshot_bandwidth.py [--models smollm2-135m gemma3-270m] [--tokens 1500] [--reps 7]
Goal: the copying restore <= 2x the memcpy of the same bytes; the others far below it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turnkv.cache.kv import KVCache  # noqa: E402
from turnkv.cache.specs import make_caches, make_pools  # noqa: E402
from turnkv.cache.snapshot import restore_snapshot, take_snapshot  # noqa: E402


def specs_for(name: str):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    ckpt = load_checkpoint(name, progress=False)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    return model.family, model.cache_specs()


def fill(specs, n: int, chunk: int = 256, pools=None):
    caches = make_caches(specs, torch.float32, pools=pools)
    g = torch.Generator().manual_seed(0)
    for pos in range(0, n, chunk):
        t = min(chunk, n - pos)
        for spec, cache in zip(specs, caches):
            k = torch.randn(spec.heads, t, spec.head_dim, generator=g)
            cache.update_and_fetch(k, k.clone())
    return caches


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def bench(name: str, n: int, reps: int) -> dict:
    family, specs = specs_for(name)
    modes = ["native"] * len(specs)
    caches = fill(specs, n, pools=make_pools(specs, torch.float32))
    snap = take_snapshot(caches, family, "bench", modes)
    nbytes = snap.nbytes
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)                                   # touch the pages once
    memcpy = median_ms(lambda: dst.copy_(src), reps)

    snap_ms = median_ms(lambda: take_snapshot(caches, family, "bench", modes), reps)
    pools = [c.pool if isinstance(c, KVCache) else None for c in caches]
    shared = [make_caches(specs, torch.float32, pools=pools) for _ in range(reps)]
    it = iter(shared)
    restore_pool = median_ms(lambda: restore_snapshot(next(it), snap, n, family, "bench", modes), reps)
    targets = [make_caches(specs, torch.float32) for _ in range(reps)]
    for t in targets:                                # preallocate the pools, as a live engine has them
        restore_snapshot(t, snap, n, family, "bench", modes)
        for c in t:
            c.reset()
    it = iter(targets)
    restore_copy = median_ms(lambda: restore_snapshot(next(it), snap, n, family, "bench", modes), reps)
    grow = fill(specs, n, pools=make_pools(specs, torch.float32))
    take_snapshot(grow, family, "bench", modes)
    g = torch.Generator().manual_seed(1)

    def snapshot_after_64():
        for spec, cache in zip(specs, grow):
            k = torch.randn(spec.heads, 64, spec.head_dim, generator=g)
            cache.update_and_fetch(k, k)
        t0 = time.perf_counter()
        take_snapshot(grow, family, "bench", modes)
        return time.perf_counter() - t0

    inc = statistics.median(snapshot_after_64() * 1000 for _ in range(reps))
    return dict(model=name, tokens=n, mib=nbytes / 2**20, memcpy=memcpy, snap=snap_ms, pool=restore_pool,
                copy=restore_copy, inc=inc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    print(f"{'model':<14} {'tokens':>6} {'MiB':>7} {'memcpy ms':>9} {'snapshot ms':>11} "
          f"{'restore (pool) ms':>17} {'restore (copy) ms':>17} {'x':>5} {'snapshot +64 ms':>15}")
    for name in args.models:
        r = bench(name, args.tokens, args.reps)
        print(f"{r['model']:<14} {r['tokens']:>6} {r['mib']:>7.1f} {r['memcpy']:>9.2f} {r['snap']:>11.2f} "
              f"{r['pool']:>17.2f} {r['copy']:>17.2f} {r['copy'] / r['memcpy']:>5.2f} {r['inc']:>15.2f}", flush=True)
    print("goal: the copying restore <= 2x memcpy of the same bytes (x); snapshot and pool restore far below")
    return 0


if __name__ == "__main__":
    sys.exit(main())
