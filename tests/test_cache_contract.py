"""The cache contract (turnkv/cache/base.py), held against a cold prefill for every state type.

The oracle is always a cold cache: a restore to ``t`` followed by more tokens must give the same
keys, values and mask (so the same attention output) as a fresh cache fed the first ``t`` tokens
and then those same tokens. Attention caches are fed random K/V; the recurrent cache is fed a toy
recurrence over its named state fields; the last tests run real (tiny, random) Llama and Gemma 3
forward passes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnkv.cache.base import (
    DIVERGED_UNTRIMMABLE,
    FAMILY_MISMATCH,
    KIND_MISMATCH,
    KV_MODE_MISMATCH,
    LENGTH_OUT_OF_RANGE,
    SHAPE_MISMATCH,
    SnapshotMismatch,
)
from turnkv.cache.chunked import ChunkedCache
from turnkv.cache.kv import KVCache
from turnkv.cache.recurrent import StateCache
from turnkv.cache.sliding import SlidingWindowCache
from turnkv.cache.specs import FULL, SLIDING, make_caches
from turnkv.cache.snapshot import (
    FINGERPRINT_MISMATCH,
    layer_min_restore,
    restore_snapshot,
    take_snapshot,
)

H, D = 2, 8
WINDOW, SLACK, CHUNK, BLOCK = 8, 4, 8, 4
KINDS = ["full", "sliding", "chunked", "recurrent"]
ATTENTION = ["full", "sliding", "chunked"]


def make_cache(kind: str, block_size: int = BLOCK, **over):
    if kind == "full":
        return KVCache(over.get("heads", H), over.get("head_dim", D), block_size=block_size,
                       mode=over.get("mode", "native"))
    if kind == "sliding":
        return SlidingWindowCache(H, D, window=over.get("window", WINDOW), slack=over.get("slack", SLACK),
                                  block_size=block_size)
    if kind == "chunked":
        return ChunkedCache(H, D, chunk=over.get("chunk", CHUNK), block_size=block_size)
    if kind == "recurrent":
        return StateCache(over.get("fields", {"conv": (H, 3), "ssm": (H, D)}))
    raise ValueError(kind)


class Stream:
    """Random per-position inputs: K, V, Q for attention caches, X for the recurrent one."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(H, n, D, generator=g)
        self.v = torch.randn(H, n, D, generator=g)
        self.q = torch.randn(H, n, D, generator=g)
        self.x = torch.randn(n, H, D, generator=g)

    def splice(self, t: int, other: "Stream") -> "Stream":
        """This stream's first ``t`` positions, then ``other``'s from ``t`` on."""
        out = Stream.__new__(Stream)
        out.k = torch.cat([self.k[:, :t], other.k[:, t:]], 1)
        out.v = torch.cat([self.v[:, :t], other.v[:, t:]], 1)
        out.q = torch.cat([self.q[:, :t], other.q[:, t:]], 1)
        out.x = torch.cat([self.x[:t], other.x[t:]], 0)
        return out


def attend(q, keys, values, mask):
    scores = q @ keys.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ values


def step_state(cache: StateCache, x: torch.Tensor) -> dict:
    """A toy recurrence over named fields (conv window + decaying sum); depends on every token."""
    for row in x:
        cache.set("ssm", cache.state["ssm"] * 0.5 + row)
        conv = torch.roll(cache.state["conv"], -1, dims=-1)
        conv[:, -1] = row.sum(-1)
        cache.set("conv", conv)
    cache.advance(x.shape[0])
    return {name: t.clone() for name, t in cache.state.items()}


def feed(cache, s: Stream, a: int, b: int, chunk: int | list[int] = 5) -> list:
    """Feed positions [a, b) in chunks; return what each call produced (cloned)."""
    assert cache.offset == a
    sizes = chunk if isinstance(chunk, list) else None
    outs, pos, i = [], a, 0
    while pos < b:
        n = min(b - pos, sizes[i % len(sizes)] if sizes else chunk)
        i += 1
        if isinstance(cache, StateCache):
            outs.append(step_state(cache, s.x[pos:pos + n]))
        else:
            view = cache.update_and_fetch(s.k[:, pos:pos + n], s.v[:, pos:pos + n])
            keys, values, mask = view.keys, view.values, view.mask
            out = attend(s.q[:, pos:pos + n], keys, values, mask)
            outs.append((keys.clone(), values.clone(), None if mask is None else mask.clone(), out))
        pos += n
    return outs


def assert_same_outputs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(g, dict):
            assert g.keys() == w.keys()
            for name in g:
                assert torch.equal(g[name], w[name]), name
            continue
        (gk, gv, gm, go), (wk, wv, wm, wo) = g, w
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
        assert (gm is None) == (wm is None) and (gm is None or torch.equal(gm, wm))
        torch.testing.assert_close(go, wo, rtol=0, atol=1e-6)


def cold_then(kind: str, s: Stream, t: int, b: int, chunk=5) -> list:
    """A fresh cache fed ``[0, t)`` then ``[t, b)``; returns the outputs of the second part."""
    cold = make_cache(kind)
    feed(cold, s, 0, t, chunk=7)
    return feed(cold, s, t, b, chunk)


def probe_twins(kind: str, s: Stream, n: int):
    """Two caches fed identically; used to show a failed restore left one of them untouched."""
    a, b = make_cache(kind), make_cache(kind)
    feed(a, s, 0, n, chunk=3)
    feed(b, s, 0, n, chunk=3)
    return a, b


def assert_untouched(cache, twin, s: Stream) -> None:
    assert cache.offset == twin.offset
    n = cache.offset
    assert_same_outputs(feed(cache, s, n, n + 4, chunk=[3, 1]), feed(twin, s, n, n + 4, chunk=[3, 1]))


def snapshot_tensors(snap) -> list[torch.Tensor]:
    return [t.clone() for part in snap.parts() for t in part.tensors.values()]


# --- basic contract ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind):
    s = Stream(60, seed=1)
    live = make_cache(kind)
    feed(live, s, 0, 37, chunk=[5, 1, 9])
    snap = live.snapshot()
    assert snap.length == 37 and snap.kind == kind
    fresh = make_cache(kind)
    fresh.restore(snap)
    assert fresh.offset == 37
    assert_same_outputs(feed(fresh, s, 37, 45, chunk=[1, 4, 3]), feed(live, s, 37, 45, chunk=[1, 4, 3]))


@pytest.mark.parametrize("kind", KINDS)
def test_snapshot_is_immutable(kind):
    s, other = Stream(400, seed=2), Stream(400, seed=3)
    live = make_cache(kind)
    feed(live, s, 0, 30)
    snap = live.snapshot()
    before = snapshot_tensors(snap)
    feed(live, s, 30, 330, chunk=64)            # grows and compacts the live buffer
    if kind != "recurrent":
        live.restore(snap, snap.length - 2)
        feed(live, other, live.offset, 40)      # overwrites positions the snapshot holds
    restored = make_cache(kind)
    restored.restore(snap)
    feed(restored, other, 30, 300, chunk=50)    # writes into a cache loaded from the snapshot
    after = [t for part in snap.parts() for t in part.tensors.values()]
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("kind", KINDS)
def test_restore_then_continue_equals_cold(kind):
    s = Stream(80, seed=4)
    live = make_cache(kind)
    feed(live, s, 0, 50, chunk=[6, 1])
    snap = live.snapshot()
    fresh = make_cache(kind)
    fresh.restore(snap)
    assert_same_outputs(feed(fresh, s, 50, 70, chunk=[7, 1, 1]), cold_then(kind, s, 50, 70, chunk=[7, 1, 1]))


# --- truncation rules at their exact boundaries ---------------------------------------------------

def guaranteed(kind: str, L: int) -> range:
    """The lengths DESIGN.md's truncation table promises, derived from the rules (not the code)."""
    if kind == "full":
        return range(0, L + 1)
    if kind == "sliding":
        unwrapped = L <= WINDOW - 1 + SLACK
        return range(0 if unwrapped else L - SLACK, L + 1)
    if kind == "chunked":
        return range((L // CHUNK) * CHUNK, L + 1)
    return range(L, L + 1)


CASES = [("full", 37), ("full", 300), ("sliding", 9), ("sliding", 40), ("sliding", 300),
         ("chunked", 21), ("chunked", 24), ("chunked", 300), ("recurrent", 13)]


@pytest.mark.parametrize("kind,L", CASES)
def test_truncation_boundary(kind, L):
    s = Stream(L + 16, seed=5)
    live = make_cache(kind)
    feed(live, s, 0, L, chunk=[7, 1, 64])
    snap = live.snapshot()
    lo = layer_min_restore(snap)
    # The restorable set is exactly the interval [lo, L] and covers what the rules promise.
    assert [t for t in range(-1, L + 2) if snap.can_restore_to(t)] == list(range(lo, L + 1))
    assert lo <= guaranteed(kind, L).start
    if kind == "sliding" and L > 100:
        assert lo > 0, "a long sliding snapshot must have dropped its front"

    # Inside: restore into a cache holding something else, continue with new tokens.
    diverged = s.splice(lo, Stream(L + 16, seed=6))
    for t in sorted({lo, min(lo + 1, L), L}):
        dirty = make_cache(kind)
        feed(dirty, Stream(L + 16, seed=7), 0, min(L, 50))
        dirty.restore(snap, t)
        assert dirty.offset == t
        cont = diverged if t == lo else s
        assert_same_outputs(feed(dirty, cont, t, t + 9, chunk=[6, 1, 2]),
                            cold_then(kind, cont, t, t + 9, chunk=[6, 1, 2]))

    # Outside: named refusal, live cache untouched.
    a, b = probe_twins(kind, Stream(L + 16, seed=8), 20)
    if lo > 0:
        with pytest.raises(SnapshotMismatch) as err:
            a.restore(snap, lo - 1)
        assert err.value.reason == DIVERGED_UNTRIMMABLE
    for bad in (-1, L + 1):
        with pytest.raises(SnapshotMismatch) as err:
            a.restore(snap, bad)
        assert err.value.reason == LENGTH_OUT_OF_RANGE
    assert_untouched(a, b, Stream(L + 16, seed=8))


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_restorable_length_equals_cold(kind, data):
    """Random lengths, chunkings and block sizes: every restorable t continues exactly like a cold run."""
    L = data.draw(st.integers(1, 120), label="L")
    block = data.draw(st.sampled_from([1, 3, 4, 16]), label="block")
    chunks = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4), label="chunks")
    s = Stream(L + 12, seed=L)
    live = make_cache(kind, block_size=block)
    feed(live, s, 0, L, chunk=chunks)
    snap = live.snapshot()
    lo = layer_min_restore(snap)
    assert lo <= guaranteed(kind, L).start
    t = data.draw(st.integers(lo, L), label="t")
    cont = s.splice(t, Stream(L + 12, seed=L + 1))
    restored = make_cache(kind, block_size=block)
    feed(restored, Stream(L + 12, seed=99), 0, data.draw(st.integers(0, L), label="dirty"), chunk=13)
    restored.restore(snap, t)
    assert_same_outputs(feed(restored, cont, t, t + 10, chunk=[4, 1]), cold_then(kind, cont, t, t + 10, chunk=[4, 1]))


# --- refusals ------------------------------------------------------------------------------------

REFUSALS = [
    ("full", {}, "sliding", {}, KIND_MISMATCH),
    ("recurrent", {}, "full", {}, KIND_MISMATCH),
    ("sliding", {}, "chunked", {}, KIND_MISMATCH),
    ("full", {}, "full", {"head_dim": 2 * D}, SHAPE_MISMATCH),
    ("full", {}, "full", {"heads": 1}, SHAPE_MISMATCH),
    ("sliding", {}, "sliding", {"window": 2 * WINDOW}, SHAPE_MISMATCH),
    ("chunked", {}, "chunked", {"chunk": 2 * CHUNK}, SHAPE_MISMATCH),
    ("recurrent", {}, "recurrent", {"fields": {"conv": (H, 4), "ssm": (H, D)}}, SHAPE_MISMATCH),
    ("full", {"mode": "bf16"}, "full", {}, KV_MODE_MISMATCH),
    ("full", {}, "full", {"mode": "fp16"}, KV_MODE_MISMATCH),
]


@pytest.mark.parametrize("src,src_over,dst,dst_over,reason", REFUSALS)
def test_wrong_kind_shape_mode_is_refused_untouched(src, src_over, dst, dst_over, reason):
    s = Stream(40, seed=9)
    source = make_cache(src, **src_over)
    feed(source, s, 0, 12)
    snap = source.snapshot()
    live, twin = make_cache(dst, **dst_over), make_cache(dst, **dst_over)
    if dst == "recurrent" or dst_over.get("heads") is None and dst_over.get("head_dim") is None:
        feed(live, s, 0, 5)
        feed(twin, s, 0, 5)
    with pytest.raises(SnapshotMismatch) as err:
        live.restore(snap)
    assert err.value.reason == reason
    assert live.offset == twin.offset
    if dst_over.get("heads") is None and dst_over.get("head_dim") is None:
        assert_untouched(live, twin, s)


# --- shared blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,n1,n2", [("full", 18, 27), ("sliding", 18, 22), ("chunked", 13, 15)])
def test_second_snapshot_shares_first_ones_blocks(kind, n1, n2):
    s = Stream(40, seed=10)
    live = make_cache(kind)
    feed(live, s, 0, n1)
    first = live.snapshot()
    assert live.snapshot().parts()[-1] is first.parts()[-1], "an unchanged cache reuses its tail"
    feed(live, s, n1, n2)
    second = live.snapshot()
    by_pos = {first.start + i * BLOCK: p for i, p in enumerate(first.blocks)}
    shared = [p for i, p in enumerate(second.blocks) if second.start + i * BLOCK in by_pos]
    assert shared, "the snapshots overlap"
    for i, part in enumerate(second.blocks):
        pos = second.start + i * BLOCK
        if pos in by_pos:
            assert part is by_pos[pos] and part.uid == by_pos[pos].uid
    # the first snapshot's partial tail is the same pool block as the second's next part (rows
    # below the first's length never change), counted once: a block's uid, a block's bytes
    assert first.tail is not None
    grown = next(p for i, p in enumerate(second.parts()) if second.start + i * BLOCK == first.length // BLOCK * BLOCK)
    assert grown.block == first.tail.block and grown.uid == first.tail.uid and grown.rows > first.tail.rows
    assert torch.equal(grown.tensors["k"][:, :first.tail.rows], first.tail.tensors["k"])


class CountingLoads:
    """Counts the slot copies a restore makes (wraps the real store method; behaviour unchanged)."""

    def __init__(self, cache):
        self.calls, self._load = 0, cache.store.load
        cache.store.load = self

    def __call__(self, slot, payload):
        self.calls += 1
        return self._load(slot, payload)


@pytest.mark.parametrize("kind", ATTENTION)
def test_restore_of_what_live_cache_holds_skips_copies(kind):
    s, other = Stream(60, seed=11), Stream(60, seed=12)
    live = make_cache(kind)
    feed(live, s, 0, 20)
    a = live.snapshot()
    feed(live, s, 20, 26)
    b = live.snapshot()
    counter = CountingLoads(live)
    live.restore(a)                     # the live cache holds every one of a's blocks
    assert counter.calls == 0 and live.offset == 20
    assert_same_outputs(feed(live, other, 20, 30, chunk=[3, 1]),
                        cold_then(kind, s.splice(20, other), 20, 30, chunk=[3, 1]))
    counter.calls = 0
    held = {name: t.clone() for name, t in b.parts()[-1].tensors.items()}
    live.restore(b)                     # positions >= 20 were overwritten: b's own blocks come back
    assert counter.calls == 0, "a restore from this pool takes references, it copies nothing"
    assert_same_outputs(feed(live, s, 26, 34, chunk=[5, 1]), cold_then(kind, s, 26, 34, chunk=[5, 1]))
    # the writes after the restore went to a block of the live cache's own (copy-on-write)
    assert all(torch.equal(t, held[name]) for name, t in b.parts()[-1].tensors.items())


@pytest.mark.parametrize("kind", ATTENTION)
def test_snapshot_from_other_block_size_restores_exactly(kind):
    """A snapshot made with another block size must restore and re-snapshot correctly."""
    s = Stream(120, seed=13)
    src = make_cache(kind, block_size=16)
    feed(src, s, 0, 70)
    snap = src.snapshot()
    for t in (layer_min_restore(snap) + 1, snap.length):   # the second keeps whole 16-token blocks
        live = make_cache(kind, block_size=BLOCK)
        feed(live, s, 0, 9)
        live.restore(snap, t)
        feed(live, s, t, 90)
        again = live.snapshot()
        for u in (layer_min_restore(again), 90):
            fresh = make_cache(kind)
            fresh.restore(again, u)
            assert_same_outputs(feed(fresh, s, u, u + 8, chunk=[3, 1]), cold_then(kind, s, u, u + 8, chunk=[3, 1]))
        assert_same_outputs(feed(live, s, 90, 98, chunk=[3, 1]), cold_then(kind, s, 90, 98, chunk=[3, 1]))


# --- model snapshots -----------------------------------------------------------------------------

def hybrid():
    return [make_cache("full"), make_cache("sliding"), make_cache("recurrent")]


def feed_all(caches, s, a, b):
    for c in caches:
        feed(c, s, a, b)


MODES = ("native", "native", "native")


def test_model_snapshot_interval_bytes_and_logits():
    s = Stream(60, seed=14)
    caches = hybrid()
    feed_all(caches, s, 0, 40)
    logits = torch.randn(32)
    snap = take_snapshot(caches, "toy", "fp1", MODES, logits=logits)
    logits.zero_()                                  # the snapshot keeps its own copy
    assert snap.logits is not None and snap.logits.abs().sum() > 0
    assert snap.length == 40 and snap.min_restore() == 40
    assert [t for t in range(42) if snap.can_restore_to(t)] == [40]
    unique = {p.uid: p.nbytes for p in snap.parts()}
    assert snap.nbytes == sum(unique.values()) + 32 * 4
    attn_only = take_snapshot(caches[:2], "toy", "fp1", MODES[:2])
    assert attn_only.min_restore() == max(layer_min_restore(x) for x in attn_only.layers) > 0
    assert [t for t in range(42) if attn_only.can_restore_to(t)] == list(range(attn_only.min_restore(), 41))


def test_take_snapshot_requires_one_offset():
    s = Stream(20, seed=15)
    caches = hybrid()
    feed_all(caches, s, 0, 10)
    feed(caches[0], s, 10, 11)
    with pytest.raises(ValueError):
        take_snapshot(caches, "toy", "fp1", MODES)


@pytest.mark.parametrize("change,reason", [
    ({"family": "other"}, FAMILY_MISMATCH),
    ({"fingerprint": "fp2"}, FINGERPRINT_MISMATCH),
    ({"modes": ("int8", "native", "native")}, KV_MODE_MISMATCH),
    ({"length": 39}, DIVERGED_UNTRIMMABLE),        # the recurrent layer refuses; the others would accept
    ({"length": 41}, LENGTH_OUT_OF_RANGE),
])
def test_model_restore_is_all_or_nothing(change, reason):
    s = Stream(60, seed=16)
    src = hybrid()
    feed_all(src, s, 0, 40)
    snap = take_snapshot(src, "toy", "fp1", MODES)
    live, twin = hybrid(), hybrid()
    other = Stream(60, seed=17)
    feed_all(live, other, 0, 25)
    feed_all(twin, other, 0, 25)
    args = {"length": 40, "family": "toy", "fingerprint": "fp1", "modes": MODES, **change}
    with pytest.raises(SnapshotMismatch) as err:
        restore_snapshot(live, snap, **args)
    assert err.value.reason == reason
    for c, t in zip(live, twin):
        assert_untouched(c, t, other)


def test_model_restore_layer_count_mismatch():
    s = Stream(20, seed=18)
    src = hybrid()
    feed_all(src, s, 0, 10)
    snap = take_snapshot(src, "toy", "fp1", MODES)
    with pytest.raises(SnapshotMismatch) as err:
        restore_snapshot(hybrid()[:2], snap, 10, "toy", "fp1", MODES)
    assert err.value.reason == SHAPE_MISMATCH


# --- real model forward passes -------------------------------------------------------------------

VOCAB = 97


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from turnkv.models.llama import LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ref = LlamaForCausalLM(config)
    return LlamaModel.from_checkpoint(config.to_dict(), ref.state_dict(), torch.float32)


@pytest.fixture(scope="module")
def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from turnkv.models.gemma3 import Gemma3Model

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16,
                              query_pre_attn_scalar=16, max_position_embeddings=2048,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    ref = Gemma3ForCausalLM(config)
    return Gemma3Model.from_checkpoint(config.to_dict(), ref.state_dict(), torch.float32)


def small_block_caches(model, slack: int):
    """The family's specs with a 4-token block, so snapshot fronts sit right at the rule's edge."""
    out = []
    for spec in model.cache_specs():
        if spec.kind == SLIDING:
            out.append(SlidingWindowCache(spec.heads, spec.head_dim, spec.window, slack=slack, block_size=4))
        else:
            assert spec.kind == FULL
            out.append(KVCache(spec.heads, spec.head_dim, block_size=4))
    return out


def run(model, caches, tokens: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """Feed ``tokens`` in the given chunk sizes (the last repeats); return every position's logits."""
    outs, pos, i = [], 0, 0
    while pos < len(tokens):
        n = min(len(tokens) - pos, chunks[min(i, len(chunks) - 1)])
        outs.append(model.step(tokens[pos:pos + n], caches, logits="all"))
        pos, i = pos + n, i + 1
    return outs


def check_model_boundary(model, make, L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (L + 12,), generator=g)
    fam, fp = model.family, "tiny"
    live = make()
    modes = tuple(c.mode for c in live)
    last = run(model, live, tokens[:L], [37, 64])[-1][-1]
    snap = take_snapshot(live, fam, fp, modes, logits=last)
    lo = snap.min_restore()
    cold = make()
    want_last = model.step(tokens[:L], cold, logits="last")
    torch.testing.assert_close(snap.logits, want_last, rtol=0, atol=1e-5)
    for t in sorted({lo, L}):
        new = torch.randint(0, VOCAB, (12,), generator=g)
        cont = torch.cat([tokens[:t], new])
        restored = make()
        run(model, restored, tokens[5:40], [35])            # something else in it first
        restore_snapshot(restored, snap, t, fam, fp, modes)
        got = run(model, restored, cont[t:], [7, 1])
        cold = make()
        model.step(cont[:t], cold, logits="none") if t else None
        want = run(model, cold, cont[t:], [7, 1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if lo > 0:
        victim, twin = make(), make()
        for caches in (victim, twin):
            model.step(tokens[:20], caches, logits="none")
        with pytest.raises(SnapshotMismatch) as err:
            restore_snapshot(victim, snap, lo - 1, fam, fp, modes)
        assert err.value.reason == DIVERGED_UNTRIMMABLE
        torch.testing.assert_close(model.step(tokens[20:25], victim, logits="all"),
                                   model.step(tokens[20:25], twin, logits="all"), rtol=0, atol=0)
    return lo


@pytest.mark.parametrize("L", [30, 300])
def test_llama_restore_any_prefix_matches_cold(tiny_llama, L):
    lo = check_model_boundary(tiny_llama, lambda: make_caches(tiny_llama.cache_specs()), L, seed=L)
    assert lo == 0


@pytest.mark.parametrize("L,block", [(20, 64), (100, 64), (300, 64), (60, 4), (300, 4)])
def test_gemma3_wrapped_ring_restore_matches_cold(tiny_gemma3, L, block):
    slack = 8
    if block == 64:
        make = lambda: make_caches(tiny_gemma3.cache_specs(), slack=slack)  # noqa: E731
    else:
        make = lambda: small_block_caches(tiny_gemma3, slack)  # noqa: E731
    lo = check_model_boundary(tiny_gemma3, make, L, seed=L + block)
    window = tiny_gemma3.args.sliding_window
    if L <= window - 1 + slack:
        assert lo == 0
    else:
        assert 0 < lo <= L - slack
        if block == 4:
            assert lo > L - slack - 4, "a 4-token block wastes at most 3 tokens of slack"
