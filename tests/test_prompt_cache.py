"""The prompt cache: radix trie, lookup rules, namespaces, refusals, budget/LRU, shared-block bytes,
subsumption, checkpoint policy, and a property test of lookup against a brute-force reference.

Snapshots are real: real caches fed K/V (or a toy recurrence) for the stored tokens.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnkv.cache import specs
from turnkv.cache.base import DIVERGED_UNTRIMMABLE, KV_MODE_MISMATCH
from turnkv.cache.kv import KVCache
from turnkv.cache.recurrent import StateCache
from turnkv.cache.sliding import SlidingWindowCache
from turnkv.prompt_cache.plan import checkpoint_positions
from turnkv.cache.snapshot import ModelSnapshot, take_snapshot
from turnkv.prompt_cache.store import OVER_BUDGET, Namespace, PromptCache
from turnkv.prompt_cache.trie import RadixTrie

FP = "fp-tiny"
VOCAB = 16
EMB = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(0))
LOGITS = 8
BIG = 1 << 30


CACHES = {
    "full": lambda: [KVCache(1, 4, block_size=4)],
    # window 2, slack 1, 1-token blocks: restorable to [L - 1, L] once L >= 3
    "sliding": lambda: [SlidingWindowCache(1, 4, window=2, slack=1, block_size=1)],
    "recurrent": lambda: [StateCache({"h": (4,)})],
}


class Live:
    """A live set of layer caches that a conversation grows; snapshots share its blocks."""

    def __init__(self, kind: str = "full", mode: str = "native", heads: int = 1, block: int = 4):
        if kind == "full":
            self.caches = [KVCache(heads, 4, block_size=block, mode=mode)]
        else:
            self.caches = CACHES[kind]()
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> "Live":
        if tokens:
            x = EMB[torch.tensor(tokens)]
            for c in self.caches:
                if isinstance(c, StateCache):
                    for row in x:
                        c.set("h", c.state["h"] * 0.5 + row)
                    c.advance(len(tokens))
                else:
                    kv = x[None].expand(c.heads, -1, -1)
                    c.update_and_fetch(kv, -kv)
        self.tokens += list(tokens)
        return self

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(c.mode for c in self.caches)

    def snap(self, logits: bool = False) -> ModelSnapshot:
        return take_snapshot(self.caches, "toy", FP, self.modes,
                             logits=torch.arange(LOGITS, dtype=torch.float32) if logits else None)


def snap_of(tokens: list[int], kind: str = "full", logits: bool = False) -> ModelSnapshot:
    return Live(kind).extend(tokens).snap(logits)


def ns(tenant: str = "", modes=("native",), fingerprint: str = FP) -> Namespace:
    return Namespace(fingerprint=fingerprint, dtype="float32", modes=modes, slack=1, tenant=tenant)


def put(cache: PromptCache, tokens, kind="full", logits=False, space=None, origin="checkpoint") -> ModelSnapshot:
    snap = snap_of(list(tokens), kind, logits)
    cache.insert(space or ns(), list(tokens), snap, origin=origin)
    return snap


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- trie --------------------------------------------------------------------------------------

def brute_groups(stored: list[tuple[tuple, object]], query) -> list[tuple[int, set]]:
    groups: dict[int, set] = {}
    for toks, v in stored:
        groups.setdefault(common(toks, query), set()).add(v)
    return sorted(groups.items(), key=lambda kv: -kv[0])


def test_trie_groups_follow_the_query_path():
    t = RadixTrie()
    stored = {(1, 2, 3, 4): "a", (1, 2, 3): "b", (1, 2, 5): "c", (1, 2): "d", (7,): "e", (): "f", (1, 2, 3, 9, 9): "g"}
    for toks, v in stored.items():
        t.insert(toks, v)
    got = [(c, set(vs)) for c, vs in t.walk((1, 2, 3, 4, 8))]
    assert got == [(4, {"a"}), (3, {"b", "g"}), (2, {"c", "d"}), (0, {"e", "f"})]
    got = [(c, set(vs)) for c, vs in t.walk((1, 2, 3, 9))]   # ends inside the edge towards "g"
    assert got == [(4, {"g"}), (3, {"a", "b"}), (2, {"c", "d"}), (0, {"e", "f"})]
    assert set(t.prefixes((1, 2, 3, 4, 8))) == {"a", "b", "d", "f"}
    assert set(t.extensions((1, 2, 3))) == {"a", "b", "g"}
    assert set(t.extensions((1, 2, 3, 9))) == {"g"} and t.extensions((1, 2, 3, 8)) == []
    t.remove((1, 2, 3))
    assert [(c, set(vs)) for c, vs in t.walk((1, 2, 3))] == [(3, {"a", "g"}), (2, {"c", "d"}), (0, {"e", "f"})]
    with pytest.raises(KeyError):
        t.remove((1, 2, 3))
    assert len(t) == 6


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), max_size=6)), max_size=30),
       query=st.lists(st.integers(0, 2), max_size=7))
def test_trie_matches_brute_force(ops, query):
    t, stored, counter = RadixTrie(), [], 0
    for is_insert, toks in ops:
        toks = tuple(toks)
        present = [p for p in stored if p[0] == toks]
        if is_insert or not present:
            counter += 1
            t.insert(toks, counter)
            stored.append((toks, counter))
        else:
            t.remove(toks, present[0][1])
            stored.remove(present[0])
    assert len(t) == len(stored)
    assert sorted(t.items()) == sorted(stored)
    got = [(c, set(vs)) for c, vs in t.walk(query)]
    assert got == brute_groups(stored, tuple(query))
    assert sorted(t.prefixes(query)) == sorted(v for k, v in stored if tuple(query[:len(k)]) == k)
    assert sorted(t.extensions(query)) == sorted(v for k, v in stored if k[:len(query)] == tuple(query))


# --- lookup ------------------------------------------------------------------------------------

Q = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_lookup_takes_the_best_usable_length():
    pc = PromptCache(BIG)
    put(pc, Q[:5])                                   # a stored prefix: u = 5
    hit = pc.lookup(ns(), Q)
    assert (hit.usable, hit.entry_length, hit.use_logits) == (5, 5, False)
    put(pc, Q[:8] + [0, 0])                          # diverges after 8, full KV trims: u = 8
    hit = pc.lookup(ns(), Q)
    assert (hit.usable, hit.entry_length) == (8, 10)
    assert pc.stats()["refusals"] == {}
    put(pc, Q[:10] + [0], kind="recurrent")          # shares 10, cannot be truncated: refused
    put(pc, Q[:11] + [0, 0, 0], kind="recurrent")    # shares 11, refused too (counted once)
    hit = pc.lookup(ns(), Q)
    assert hit.usable == 8
    assert pc.stats()["refusals"] == {DIVERGED_UNTRIMMABLE: 1}
    put(pc, Q[:9] + [0, 0, 0, 0, 0], kind="sliding")  # shares 9, restorable only to 13..14
    assert pc.lookup(ns(), Q).usable == 8
    put(pc, Q[:9] + [0], kind="sliding")             # shares 9, restorable to 9..10: wins
    hit = pc.lookup(ns(), Q)
    assert (hit.usable, hit.entry_length) == (9, 10)
    st_ = pc.stats()
    assert st_["lookups"] == 5 and st_["hits"] == 5 and st_["misses"] == 0
    assert st_["tokens_reused"] == 5 + 8 + 8 + 8 + 9
    assert st_["refusals"] == {DIVERGED_UNTRIMMABLE: 3}


def test_a_stored_recurrent_prefix_is_usable():
    pc = PromptCache(BIG)
    put(pc, Q[:6], kind="recurrent")
    put(pc, Q[:9] + [0], kind="recurrent")
    hit = pc.lookup(ns(), Q)
    assert hit.usable == 6 and pc.stats()["refusals"] == {DIVERGED_UNTRIMMABLE: 1}


@pytest.mark.parametrize("kind,logits,want", [
    ("full", False, (11, False)),       # leave one token to prefill
    ("full", True, (12, True)),         # exact tokens with logits: nothing to prefill
    ("recurrent", True, (12, True)),
    ("recurrent", False, None),         # would need 11, cannot truncate
    ("sliding", False, (11, False)),    # len - 1 is inside the slack
])
def test_exact_match_cap_and_logits(kind, logits, want):
    pc = PromptCache(BIG)
    put(pc, Q, kind=kind, logits=logits)
    hit = pc.lookup(ns(), Q)
    assert (None if hit is None else (hit.usable, hit.use_logits)) == want
    if want is None:
        assert pc.stats()["refusals"] == {DIVERGED_UNTRIMMABLE: 1} and pc.stats()["misses"] == 1


def test_longer_entry_with_logits_still_leaves_one_token():
    pc = PromptCache(BIG)
    put(pc, Q + [13, 14], logits=True)
    hit = pc.lookup(ns(), Q)
    assert (hit.usable, hit.use_logits, hit.entry_length) == (11, False, 14)
    assert pc.lookup(ns(), []) is None and pc.lookup(ns(), [1]) is None   # u = 0 is a miss


def test_namespaces_are_isolated():
    pc = PromptCache(BIG)
    put(pc, Q, space=ns("alice"))
    assert pc.lookup(ns("bob"), Q) is None
    assert pc.lookup(ns(), Q) is None
    assert pc.lookup(ns("alice"), Q).usable == 11
    assert pc.lookup(Namespace(FP, "bfloat16", ("native",), 1, "alice"), Q) is None     # other dtype
    assert pc.lookup(Namespace(FP, "float32", ["native"], 2, "alice"), Q) is None       # other slack
    live = Live().extend(Q)
    other_weights = take_snapshot(live.caches, "toy", "other", live.modes)
    assert pc.insert(ns("alice", fingerprint="other"), Q, other_weights)
    assert pc.lookup(ns("alice"), Q).snapshot.fingerprint == FP
    st_ = pc.stats()
    assert st_["namespaces"] == 2 and st_["entries"] == 2 and st_["refusals"] == {}
    with pytest.raises(ValueError):                 # a snapshot is filed under its own namespace
        pc.insert(ns(fingerprint="wrong"), Q, snap_of(Q))


def test_kv_mode_mismatch_is_a_named_refusal():
    pc = PromptCache(BIG)
    bf16 = ns(modes=("bf16",))
    snap = Live("full", mode="bf16").extend(Q).snap()
    assert pc.insert(bf16, Q, snap)
    assert pc.lookup(ns(), Q) is None
    assert pc.stats()["refusals"] == {KV_MODE_MISMATCH: 1}
    put(pc, Q[:4])                                  # a shorter native match: still counted
    assert pc.lookup(ns(), Q).usable == 4
    assert pc.stats()["refusals"] == {KV_MODE_MISMATCH: 2}
    put(pc, Q[:11] + [0])                           # as long as the bf16 one: no refusal
    assert pc.lookup(ns(), Q).usable == 11
    assert pc.lookup(ns("tenant-b"), Q) is None     # other tenant, other fingerprint: not refusals
    assert pc.lookup(ns(fingerprint="x"), Q) is None
    assert pc.stats()["refusals"] == {KV_MODE_MISMATCH: 2}
    assert pc.lookup(bf16, Q).usable == 11


def test_budget_zero_is_off():
    pc = PromptCache(0)
    assert not pc.enabled
    assert pc.insert(ns(), Q, snap_of(Q)) is False
    assert pc.lookup(ns(), Q) is None
    st_ = pc.stats()
    assert (st_["lookups"], st_["misses"], st_["hits"], st_["entries"], st_["bytes"]) == (1, 1, 0, 0, 0)


def test_rejects_bad_inserts():
    pc = PromptCache(BIG)
    with pytest.raises(ValueError):
        pc.insert(ns(), Q[:3], snap_of(Q))          # key does not match the snapshot's length
    with pytest.raises(ValueError):
        pc.insert(ns(), Q, snap_of(Q), origin="magic")


# --- bytes, budget, LRU ----------------------------------------------------------------------------

def test_lru_eviction_order_and_bytes():
    convs = [[c] + Q for c in (1, 2, 3)]            # three unrelated conversations
    snaps = [snap_of(t) for t in convs]
    size = snaps[0].nbytes
    assert all(s.nbytes == size for s in snaps)
    pc = PromptCache(int(size * 2.5))
    assert pc.insert(ns(), convs[0], snaps[0]) and pc.insert(ns(), convs[1], snaps[1])
    assert pc.stats()["bytes"] == 2 * size
    assert pc.lookup(ns(), convs[0]) is not None     # A is now the most recently used
    assert pc.insert(ns(), convs[2], snaps[2])
    st_ = pc.stats()
    assert (st_["entries"], st_["bytes"], st_["evictions"]) == (2, 2 * size, 1)
    assert pc.lookup(ns(), convs[1]) is None          # B went first
    assert pc.lookup(ns(), convs[0]) is not None and pc.lookup(ns(), convs[2]) is not None


def test_entry_over_the_whole_budget_is_refused():
    snap = snap_of(Q)
    pc = PromptCache(snap.nbytes - 1)
    put(pc, [5, 5])
    assert pc.insert(ns(), Q, snap) is False
    st_ = pc.stats()
    assert st_["refusals"] == {OVER_BUDGET: 1} and st_["entries"] == 1 and st_["evictions"] == 0


@pytest.mark.parametrize("with_logits", [False, True])
def test_growing_conversation_shares_blocks(with_logits):
    live = Live("full", heads=4, block=16)
    pc = PromptCache(BIG)
    snaps = []
    for turn in range(8):
        live.extend([(turn * 7 + i) % VOCAB for i in range(25)])
        snaps.append(live.snap(logits=with_logits))
        assert pc.insert(ns(), live.tokens, snaps[-1], origin="generation")
        for older, newer in zip(snaps[-2:-1], snaps[-1:]):
            shared = {p.uid for p in older.parts()} & {p.uid for p in newer.parts()}
            assert len(shared) >= len(older.layers[0].blocks)     # every full block is reused
    final = snaps[-1].nbytes
    naive = sum(s.nbytes for s in snaps)
    st_ = pc.stats()
    tail_bound = 8 * (15 * 2 * 4 * 4 * 4 + LOGITS * 4)        # a partial block + logits per turn
    assert final <= st_["bytes"] <= final + tail_bound
    assert st_["bytes"] < 1.5 * final and naive > 4 * final
    # Without logits every older turn is subsumed by the newer one; with them each turn keeps
    # its own entry (its logits are for its own length), but its blocks are shared.
    assert st_["entries"] == (8 if with_logits else 1)
    for n in range(25, 201, 25):
        hit = pc.lookup(ns(), live.tokens[:n] + [0])
        assert hit.usable == n


def test_evicting_an_entry_keeps_blocks_a_newer_one_shares():
    live = Live("full", heads=4, block=4)
    a = live.extend(Q).snap(logits=True)
    a_tokens = list(live.tokens)
    b = live.extend([3, 3, 3, 3]).snap(logits=True)
    other = snap_of([9] * 12, logits=True)
    both = {p.uid: p.nbytes for s in (a, b) for p in s.parts()}
    assert set(both) == {p.uid for p in b.parts()}     # a's blocks all live on in b
    pc = PromptCache(b.nbytes + other.nbytes)
    assert pc.insert(ns(), a_tokens, a) and pc.insert(ns(), live.tokens, b)
    assert pc.stats()["bytes"] == sum(both.values()) + 2 * LOGITS * 4
    assert pc.insert(ns(), [9] * 12, other)       # pushes out a (least recent), then fits
    st_ = pc.stats()
    assert st_["evictions"] == 1 and st_["bytes"] == b.nbytes + other.nbytes
    assert pc.lookup(ns(), a_tokens).entry_length == len(live.tokens)   # b serves a's prefix


def test_subsumption():
    pc = PromptCache(BIG)
    long = snap_of(Q)
    assert pc.insert(ns(), Q, long)
    assert pc.insert(ns(), Q[:6], snap_of(Q[:6])) is False            # the longer entry covers it
    assert pc.stats()["entries"] == 1
    assert pc.insert(ns(), Q[:6], snap_of(Q[:6], logits=True))       # carries logits the other lacks
    assert pc.insert(ns(), Q + [1, 1], snap_of(Q + [1, 1]))            # removes Q (not Q[:6] + logits)
    st_ = pc.stats()
    assert st_["entries"] == 2
    hit = pc.lookup(ns(), Q[:6])
    assert hit.use_logits and hit.usable == 6
    assert pc.lookup(ns(), Q).entry_length == 14
    # A wrapped sliding ring cannot serve its own earlier checkpoints: both stay.
    pc2 = PromptCache(BIG)
    assert pc2.insert(ns(), Q[:6], snap_of(Q[:6], "sliding"))
    assert pc2.insert(ns(), Q, snap_of(Q, "sliding"))
    assert pc2.stats()["entries"] == 2
    assert pc2.lookup(ns(), Q[:6] + [0]).usable == 6
    # An unwrapped one can; one that wrapped keeps the shorter one beside it.
    assert pc2.insert(ns(), [4, 4], snap_of([4, 4], "sliding"))
    assert pc2.insert(ns(), [4], snap_of([4], "sliding")) is False
    assert pc2.insert(ns(), [4, 4, 4], snap_of([4, 4, 4], "sliding"))
    assert pc2.stats()["entries"] == 4


def test_clear_and_bookkeeping():
    pc = PromptCache(BIG)
    put(pc, Q)
    pc.lookup(ns(), Q)
    pc.record_prefill(7)
    pc.record_refusal("family_mismatch")
    pc.clear()
    st_ = pc.stats()
    assert (st_["entries"], st_["bytes"], st_["namespaces"]) == (0, 0, 0)
    assert (st_["lookups"], st_["hits"], st_["tokens_prefilled"]) == (1, 1, 7)
    assert st_["refusals"] == {"family_mismatch": 1} and st_["budget_bytes"] == BIG
    assert pc.lookup(ns(), Q) is None


def test_concurrent_use_keeps_accounting_consistent():
    pc = PromptCache(3 * snap_of(Q).nbytes)
    snaps = {c: snap_of([c] + Q) for c in range(6)}
    errors = []

    def worker(seed):
        try:
            for i in range(60):
                c = (seed + i) % 6
                pc.insert(ns(), [c] + Q, snaps[c])
                pc.lookup(ns(), [c] + Q)
                pc.stats()
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st_ = pc.stats()
    assert st_["bytes"] == st_["entries"] * snaps[0].nbytes <= pc.budget_bytes
    assert st_["lookups"] == 240 == st_["hits"] + st_["misses"]


# --- property test: lookup against a brute-force reference -------------------------------------

def reference(entries: list[tuple[tuple, ModelSnapshot]], q: tuple) -> tuple[int, bool, bool]:
    """(best usable length, use_logits, refused) over every entry ever inserted, by definition."""
    n = len(q)
    cands = []
    for toks, snap in entries:
        c = common(toks, q)
        exact = c == n and len(toks) == n and snap.logits is not None
        want = min(c, n if exact else n - 1)
        cands.append((want, want > 0 and snap.can_restore_to(want)))
    best = max([w for w, ok in cands if ok], default=0)
    refused = any(w > best and not ok for w, ok in cands)
    return best, best == n and best > 0, refused


token_lists = st.lists(st.integers(0, 2), max_size=9)
# A query is a cut of one inserted sequence (or of nothing) plus a suffix: exact hits, prefixes,
# extensions and divergences all come up often.
query_specs = st.tuples(st.integers(0, 20), st.integers(0, 10), st.lists(st.integers(0, 2), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inserts=st.lists(st.tuples(token_lists, st.sampled_from(["full", "sliding", "recurrent"]), st.booleans()),
                        max_size=12),
       queries=st.lists(query_specs, min_size=1, max_size=6))
def test_lookup_matches_brute_force(inserts, queries):
    pc = PromptCache(BIG)
    entries, tokens_of = [], {}
    for toks, kind, logits in inserts:
        snap = snap_of(toks, kind, logits)
        pc.insert(ns(), toks, snap)
        entries.append((tuple(toks), snap))
        tokens_of[id(snap)] = tuple(toks)
    for which, cut, suffix in queries:
        base = inserts[which % len(inserts)][0] if inserts else []
        q = list(base[:cut]) + suffix
        before = pc.stats()["refusals"].get(DIVERGED_UNTRIMMABLE, 0)
        hit = pc.lookup(ns(), q)
        best, use_logits, refused = reference(entries, tuple(q))
        got = (0, False) if hit is None else (hit.usable, hit.use_logits)
        assert got == (best, use_logits)
        assert pc.stats()["refusals"].get(DIVERGED_UNTRIMMABLE, 0) - before == int(refused)
        if hit is not None:
            stored = tokens_of[id(hit.snapshot)]
            assert stored[:hit.usable] == tuple(q[:hit.usable]) and hit.entry_length == len(stored)
            assert hit.snapshot.can_restore_to(hit.usable)
            assert hit.use_logits == (hit.usable == len(q))


# --- checkpoint policy ---------------------------------------------------------------------------

def test_checkpoint_positions():
    full = [specs.full(1, 4)] * 2
    gemma = [specs.sliding(1, 4, 8), specs.full(1, 4)]
    hybrid = [specs.recurrent(h=(4,)), specs.full(1, 4)]
    # message boundaries strictly inside the part to prefill (the prompt's end has its own snapshot)
    assert checkpoint_positions(full, [5, 10, 20], 0, 25) == []
    assert checkpoint_positions(gemma, [5, 10, 20], 0, 25) == [5, 10, 20]
    assert checkpoint_positions(hybrid, [20, 5, 10, 25, 30], 10, 25) == [20]
    assert checkpoint_positions(hybrid, [5], 25, 25) == []
    assert checkpoint_positions([specs.chunked(1, 4, 8)], [], 3, 9) == []


# --- tenants: per-owner budget share, scoped flush and stats ---------------------------------------


def owned(owner: str, salt: str = "") -> Namespace:
    return Namespace(fingerprint=FP, dtype="float32", modes=("native",), slack=1, tenant=f"{owner}/{salt}",
                     owner=owner)


def test_a_tenant_over_its_share_evicts_only_its_own_entries():
    convs = [[c] + Q for c in range(1, 9)]
    size = snap_of(convs[0]).nbytes
    # the global budget holds 6 entries, each tenant's share 2: without the share, alice's flood
    # of 6 unique prompts would push bob's (older) entry out of the global LRU
    pc = PromptCache(6 * size, tenant_budget_bytes=2 * size)
    assert pc.insert(owned("bob"), convs[0], snap_of(convs[0]))
    for conv in convs[1:7]:
        assert pc.insert(owned("alice"), conv, snap_of(conv))
    assert pc.lookup(owned("bob"), convs[0]) is not None            # bob's entry survived the flood
    alice, bob = pc.stats("alice"), pc.stats("bob")
    assert (alice["entries"], alice["bytes"], alice["evictions"], alice["budget_bytes"]) == (2, 2 * size, 4, 2 * size)
    assert (bob["entries"], bob["bytes"], bob["evictions"], bob["hits"]) == (1, size, 0, 1)
    assert [pc.lookup(owned("alice"), c) is not None for c in convs[1:7]] == [False] * 4 + [True] * 2
    everyone = pc.stats()
    assert everyone["bytes"] == 3 * size and everyone["evictions"] == 4
    assert everyone["tenants"] == {"alice": {"entries": 2, "bytes": 2 * size}, "bob": {"entries": 1, "bytes": size}}


def test_without_a_share_the_global_lru_evicts_across_tenants():
    """The control for the test above: the same flood with no per-tenant share evicts bob."""
    convs = [[c] + Q for c in range(1, 9)]
    size = snap_of(convs[0]).nbytes
    pc = PromptCache(6 * size)
    pc.insert(owned("bob"), convs[0], snap_of(convs[0]))
    for conv in convs[1:7]:
        pc.insert(owned("alice"), conv, snap_of(conv))
    assert pc.lookup(owned("bob"), convs[0]) is None and pc.stats("bob")["evictions"] == 1


def test_a_tenant_flush_leaves_the_others_and_counts_what_it_freed():
    live = Live("full", heads=2, block=4)
    pc = PromptCache(BIG)
    for salt in ("", "s1"):                              # two namespaces of alice's
        pc.insert(owned("alice", salt), Q, snap_of(Q))
    live.extend(Q)
    pc.insert(owned("bob"), Q, live.snap())
    alice_bytes = pc.stats("alice")["bytes"]
    assert pc.stats("alice")["namespaces"] == 2
    assert pc.clear("alice") == (2, alice_bytes)
    assert pc.stats("alice")["entries"] == 0 and pc.lookup(owned("alice"), Q) is None
    assert pc.lookup(owned("bob"), Q) is not None and pc.stats("bob")["entries"] == 1
    assert pc.clear("nobody") == (0, 0)
    removed, freed = pc.clear()
    assert removed == 1 and freed > 0 and pc.stats()["bytes"] == 0


