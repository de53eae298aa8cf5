"""The per-layer KV block pool (cache/blocks.py): references, copy-on-write, release, growth.

Every test checks the cache's answers against a cold cache fed the same K/V, and the pool's
bookkeeping (which blocks are shared, copied, freed) against what the design says it must be."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from turnkv.cache.blocks import BlockPool
from turnkv.cache.kv import KVCache
from turnkv.cache.sliding import SlidingWindowCache

H, D, B = 2, 16, 8          # small blocks, so a few dozen tokens span several


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g)


def feed(cache, k, v, a: int, b: int, step: int = 5) -> list[torch.Tensor]:
    """Positions [a, b) of k / v; the keys each call returned (copies)."""
    assert cache.offset == a
    out = []
    for p in range(a, b, step):
        view = cache.update_and_fetch(k[:, p:min(b, p + step)], v[:, p:min(b, p + step)])
        out.append(torch.cat([view.keys, view.values], -1).clone())
    return out


def cold(k, v, n: int, then: int, make=lambda pool=None: KVCache(H, D, block_size=B, pool=pool)):
    c = make()
    feed(c, k, v, 0, n)
    return feed(c, k, v, n, then)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_restore_takes_references_and_divergent_writes_copy_on_write():
    """Two live caches restore one snapshot: they hold its blocks (no new block for the whole
    ones), each continues with its own tokens into a block of its own, and neither disturbs the
    other or the snapshot: both equal a cold run of their own tokens."""
    k, v = kv(60, 1)
    k2, v2 = kv(60, 2)
    pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)
    src = KVCache(H, D, block_size=B, pool=pool)
    feed(src, k, v, 0, 21)                      # 2 whole blocks + 5 rows
    snap = src.snapshot()
    held = {n: t.clone() for n, t in snap.tail.tensors.items()}
    a, b = KVCache(H, D, block_size=B, pool=pool), KVCache(H, D, block_size=B, pool=pool)
    used = pool.used
    a.restore(snap)
    b.restore(snap)
    assert a.block_ids() == b.block_ids() == src.block_ids() and pool.used == used
    mix_k, mix_v = torch.cat([k[:, :21], k2[:, 21:]], 1), torch.cat([v[:, :21], v2[:, 21:]], 1)
    got_a = feed(a, k, v, 21, 40)
    got_b = feed(b, mix_k, mix_v, 21, 40)
    got_src = feed(src, k, v, 21, 30)
    assert same(got_a, cold(k, v, 21, 40)) and same(got_b, cold(mix_k, mix_v, 21, 40))
    assert same(got_src, cold(k, v, 21, 30))
    assert all(torch.equal(t, held[n]) for n, t in snap.tail.tensors.items()), "a snapshot never changes"
    assert a.block_ids()[:2] == b.block_ids()[:2] == src.block_ids()[:2]      # the whole blocks stay shared
    assert len({a.block_ids()[2], b.block_ids()[2], src.block_ids()[2]}) == 3  # the partial one: one each


def test_owner_appends_in_place_and_a_released_partial_block_is_adopted():
    """The cache that owns a partial block keeps appending to it after a snapshot (rows past the
    seal), and once it lets go, a cache restoring that snapshot adopts the block instead of
    copying it; a truncation below the seal copies."""
    k, v = kv(40, 3)
    pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)
    src = KVCache(H, D, block_size=B, pool=pool)
    feed(src, k, v, 0, 13)
    snap = src.snapshot()
    tail = src.block_ids()[1]
    feed(src, k, v, 13, 15)
    assert src.block_ids()[1] == tail, "the owner writes past the seal in place"
    src.reset()
    dst = KVCache(H, D, block_size=B, pool=pool)
    dst.restore(snap)
    got = feed(dst, k, v, 13, 30)
    assert dst.block_ids()[1] == tail, "nobody owned it and no part holds rows past 13: adopted"
    assert same(got, cold(k, v, 13, 30))
    again = KVCache(H, D, block_size=B, pool=pool)
    again.restore(dst.snapshot(), 10)           # rows 10.. of that block are sealed by the snapshot
    assert same(feed(again, k, v, 10, 20), cold(k, v, 10, 20))
    assert again.block_ids()[1] != tail


def test_the_owner_going_back_below_the_seal_copies_first():
    """A regenerate: the owner restores its own snapshot to a shorter length and writes other
    tokens there; the snapshot's rows (sealed) must not change, so it writes into a copy."""
    k, v = kv(30, 7)
    k2, v2 = kv(30, 8)
    own = KVCache(H, D, block_size=B)
    feed(own, k, v, 0, 13)
    snap = own.snapshot()
    held = {n: t.clone() for n, t in snap.tail.tensors.items()}
    tail = own.block_ids()[1]
    own.restore(snap, 10)
    mix_k, mix_v = torch.cat([k[:, :10], k2[:, 10:]], 1), torch.cat([v[:, :10], v2[:, 10:]], 1)
    assert same(feed(own, mix_k, mix_v, 10, 20), cold(mix_k, mix_v, 10, 20))
    assert own.block_ids()[1] != tail
    assert all(torch.equal(t, held[n]) for n, t in snap.tail.tensors.items())
    fresh = KVCache(H, D, block_size=B)
    fresh.restore(snap)
    assert same(feed(fresh, k, v, 13, 20), cold(k, v, 13, 20))


def test_blocks_return_to_the_pool_when_the_last_holder_goes():
    k, v = kv(40, 4)
    pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)
    live = KVCache(H, D, block_size=B, pool=pool)
    feed(live, k, v, 0, 30)
    snaps = [live.snapshot()]
    feed(live, k, v, 30, 40)
    snaps.append(live.snapshot())
    assert pool.used == 5
    live.reset()
    assert pool.used == 5, "the snapshots still hold every block"
    snaps.pop()                                  # the longer one: its last two blocks go
    gc.collect()
    assert pool.used == 4
    box = [snaps.pop()]
    t = threading.Thread(target=box.clear)       # a snapshot dropped on another thread (a tier writer)
    t.start()
    t.join()
    gc.collect()
    assert pool.used == 0 and sorted(pool.free) == list(range(pool.blocks))


def test_sliding_window_releases_what_leaves_it():
    """A sliding layer holds about window + slack positions of blocks, whatever the length, and
    still equals a cold run; blocks a snapshot holds stay until it goes."""
    k, v = kv(200, 5)
    pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)

    def make(pool=pool):
        return SlidingWindowCache(H, D, window=12, slack=6, block_size=B, pool=pool)

    live = make()
    feed(live, k, v, 0, 100)
    snap = live.snapshot()
    feed(live, k, v, 100, 200)
    assert len(live.block_ids()) <= (12 - 1 + 6) // B + 3
    assert same(feed(make(), k, v, 0, 200)[-5:], feed(make(None), k, v, 0, 200)[-5:])
    before = pool.used
    del snap
    gc.collect()
    assert pool.used < before
    restored = make()
    restored.restore(live.snapshot(), 195)
    assert same(feed(restored, k, v, 195, 200), cold(k, v, 195, 200, make=lambda: make(None)))


@pytest.mark.parametrize("mode", ["native", "fp16", "int8", "int4"])
def test_pool_growth_keeps_every_block(mode):
    """The pool doubles when it runs out of blocks; blocks keep their ids and bytes, so live
    caches and snapshots made before the growth read the same values after it."""
    k, v = kv(64, 6)
    pool = BlockPool(mode, H, D, torch.float32, "cpu", block=B, blocks=2)
    first = KVCache(H, D, mode=mode, block_size=B, pool=pool)
    feed(first, k, v, 0, 16)
    snap = first.snapshot()
    before = [{n: t.clone() for n, t in p.tensors.items()} for p in snap.parts()]
    others = [KVCache(H, D, mode=mode, block_size=B, pool=pool) for _ in range(3)]
    for c in others:
        feed(c, k, v, 0, 40)                    # the pool grows under them
    assert pool.blocks > 2
    for p, was in zip(snap.parts(), before):
        assert all(torch.equal(t, was[n]) for n, t in p.tensors.items())
    assert same(feed(first, k, v, 16, 30), cold(k, v, 16, 30, make=lambda: KVCache(H, D, mode=mode, block_size=B)))


def test_a_pool_refuses_caches_of_another_shape():
    pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)
    with pytest.raises(ValueError, match="block pool"):
        KVCache(H, D * 2, block_size=B, pool=pool)
    with pytest.raises(ValueError, match="block pool"):
        KVCache(H, D, mode="int8", block_size=B, pool=pool)


def test_reserve_short_path_answers_as_the_general_one(monkeypatch):
    """Full attention's ``reserve`` shortcut (a decode row inside the cache's own last block) gives
    the same answers, offsets, blocks and K/V as the general path, through appends, a snapshot
    that seals the owner's block, a restore that shares it and a regenerate below the seal; rules
    that release blocks (sliding, chunked) never take it."""
    from turnkv.cache.chunked import ChunkedCache

    assert KVCache._keeps_all and not SlidingWindowCache._keeps_all and not ChunkedCache._keeps_all
    k, v = kv(60, 11)
    k2, v2 = kv(60, 12)
    log: list = []
    general = [0]
    reserve, own_rows = KVCache.reserve, KVCache._own_rows

    def logged_reserve(self, T):
        got = reserve(self, T)
        log.append((got, self.offset, self.block_ids()))
        return got

    def counted_own_rows(self, T):
        general[0] += 1
        return own_rows(self, T)

    monkeypatch.setattr(KVCache, "reserve", logged_reserve)
    monkeypatch.setattr(KVCache, "_own_rows", counted_own_rows)

    def script() -> list:
        log.clear()
        general[0] = 0
        pool = BlockPool("native", H, D, torch.float32, "cpu", block=B)
        a = KVCache(H, D, block_size=B, pool=pool)
        out = feed(a, k, v, 0, 21, step=1)
        snap = a.snapshot()
        out += feed(a, k, v, 21, 27, step=1)          # the owner writes past the seal
        b = KVCache(H, D, block_size=B, pool=pool)
        b.restore(snap)
        out += feed(b, k2, v2, 21, 30, step=1)        # shares the sealed block: copies it first
        a.restore(snap, 18)                           # regenerate below the seal
        out += feed(a, k2, v2, 18, 33, step=1)
        return [list(log), out, a.block_ids(), b.block_ids(), pool.used, general[0]]

    fast = script()
    monkeypatch.setattr(KVCache, "_keeps_all", False)
    slow = script()
    assert fast[-1] < slow[-1], "the shortcut was never taken"
    assert fast[0] == slow[0] and fast[2:-1] == slow[2:-1]
    assert same(fast[1], slow[1])


def _pointers(pool: BlockPool) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in pool.store.parts.items()}


@pytest.mark.parametrize("mode", ["native", "fp16", "int8", "int4"])
def test_a_reserved_pool_opens_blocks_without_copying(mode):
    """Inside its reserve a pool hands out blocks from the store it was given at the start (no
    reallocation, no copy), counts only the blocks opened in ``nbytes``; past the reserve it
    reallocates as an unreserved pool does, and the blocks written before read the same after."""
    k, v = kv(80, 7)
    pool = BlockPool(mode, H, D, torch.float32, "cpu", block=B, reserve=24)
    assert pool.reserved == 24 and pool.blocks == 0 and pool.nbytes == 0
    start = _pointers(pool)
    first = KVCache(H, D, mode=mode, block_size=B, pool=pool)
    feed(first, k, v, 0, 64)
    assert pool.blocks == 16 and pool.nbytes == 16 * pool.block_bytes < pool.store.nbytes
    snap = first.snapshot()
    before = [{n: t.clone() for n, t in p.tensors.items()} for p in snap.parts()]
    second = KVCache(H, D, mode=mode, block_size=B, pool=pool)
    feed(second, k, v, 0, 80)               # 8 + 10 blocks: more than the first 16 opened
    assert 16 < pool.blocks <= 24
    assert _pointers(pool) == start         # the same store: nothing was copied
    assert pool.nbytes == pool.blocks * pool.block_bytes
    third = KVCache(H, D, mode=mode, block_size=B, pool=pool)
    feed(third, k, v, 0, 80)                # 10 more: past the reserve
    assert pool.blocks > 24 and pool.reserved >= pool.blocks
    assert _pointers(pool) != start         # reallocated once it had to be
    for p, was in zip(snap.parts(), before):
        assert all(torch.equal(t, was[n]) for n, t in p.tensors.items())
    assert same(feed(first, k, v, 64, 80), cold(k, v, 64, 80, make=lambda: KVCache(H, D, mode=mode, block_size=B)))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_a_reserve_is_kept_on_small_pages():
    """The reserve's pages are advised MADV_NOHUGEPAGE (the kernel's VmFlags say ``nh`` for the
    mapping that holds it), so memory follows the blocks written even on transparent huge pages."""
    pool = BlockPool("fp16", 4, 64, torch.float32, "cpu", reserve=256)       # 8 MiB a part
    t = pool.store.parts["k"]
    inside = (t.data_ptr() + 2 * 4096) & ~4095
    flags = None
    with open("/proc/self/smaps") as f:
        span = None
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                span = lo <= inside < hi
            elif span and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None, "no mapping holds the reserve"
    assert "nh" in flags, flags


def test_reserve_plan_follows_what_each_layer_keeps():
    """Full attention reserves its sequences' whole context, a sliding layer its window plus a
    prefill chunk and the slack; both add the prompt cache's budget as whole blocks of every
    layer; the total is scaled down to the limit, and no limit means no reserve."""
    from turnkv.cache.slots import reserve_plan
    from turnkv.cache.specs import full, sliding

    specs = [full(H, D), sliding(H, D, 100), full(H, D)]
    pools = [BlockPool("native", H, D, torch.float32, "cpu", block=B) for _ in specs]
    row = sum(p.block_bytes for p in pools)
    whole = reserve_plan(specs, pools, 3, 1000, 32, 16, cache_bytes=10 * row, limit=1 << 40)
    per_seq_full, per_seq_sliding = -(-1000 // B) + 1, -(-(100 + 32 + 16) // B) + 1
    assert whole == [3 * per_seq_full + 10, 3 * per_seq_sliding + 10, 3 * per_seq_full + 10]
    short = reserve_plan(specs, pools, 3, 40, 32, 16, cache_bytes=0, limit=1 << 40)
    assert short[0] == short[1] == 3 * (-(-40 // B) + 1)       # a context shorter than the window
    total = sum(n * p.block_bytes for n, p in zip(whole, pools))
    half = reserve_plan(specs, pools, 3, 1000, 32, 16, cache_bytes=10 * row, limit=total // 2)
    assert sum(n * p.block_bytes for n, p in zip(half, pools)) <= total // 2
    assert all(abs(h - w / 2) <= 1 for h, w in zip(half, whole))
    assert reserve_plan(specs, pools, 3, 1000, 32, 16, cache_bytes=0, limit=0) == [0, 0, 0]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_a_refused_reserve_leaves_a_working_pool():
    """Under an address-space limit (``ulimit -v``) the plan shrinks to half of what is left, and a
    reserve the kernel refuses returns False with the store as it was; the pool then works as an
    unreserved one (a server under such a limit failed to start before this)."""
    import subprocess
    import sys
    code = """
import resource, torch
from turnkv.cache.blocks import BlockPool
from turnkv.cache.kv import KVCache
from turnkv.cache.slots import reservable_bytes
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
left = reservable_bytes()
assert 0 < left <= 128 << 20, left
pool = BlockPool("fp16", 2, 64, torch.float32, "cpu", block=8)
assert pool.reserve((1 << 30) // pool.block_bytes) is False and pool.reserved == 0
cache = KVCache(2, 64, mode="fp16", block_size=8, pool=pool)
k = torch.randn(2, 40, 64)
view = cache.update_and_fetch(k, k)
assert pool.blocks >= 5 and torch.equal(view.keys, k.half().float())
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
