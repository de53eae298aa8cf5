"""The native attention kernel (turnkv/kernels/csrc/attention.cpp, docs/kernels.md).

- native vs the PyTorch reference (kernels/attention.py) within ATOL, for full / sliding / chunked,
  grouped-query, softcap, T=1 and T=100, odd head dims, strided q (the families' transposed qkv);
- invariance, on every ISA path: the output rows of the queries at positions [a, b) are
  bit-identical (torch.equal) whether computed in one call over all queries, in chunks of 1, 7 or
  64 queries (each chunk with the keys a cache would hand it), alone, with extra invisible keys in
  front of the key range, or on 1 vs 2 threads; only the visible keys matter;
- attention sinks (gpt-oss): native vs reference on every ISA path, and the same invariance;
- through the cache interface (``KVView``) the kernel agrees with the SDPA fallback;
- end to end on the bundled models with ``--weights gguf``: the logits of a 400 / 600-token prompt
  are bit-identical prefilled in one chunk, in chunks of 64, as the first N tokens then the rest
  (restored from a snapshot into fresh caches, as a cache hit does) and in chunks of 64 sharing each
  forward with another sequence. Gemma 3's prompt is longer than its 512-token sliding window.
  The same comparison through the SDPA path (``TURNKV_ATTENTION=reference``) differs, which is
  what the kernel fixes (not asserted: SDPA's blocking is torch's business).
"""

from __future__ import annotations

import contextlib

from pathlib import Path

import pytest
import torch

import native
from turnkv.cache.blocks import BlockPool
from turnkv.cache.kv import KVCache
from turnkv.cache.chunked import ChunkedCache
from turnkv.cache.sliding import SlidingWindowCache
from turnkv.kernels import attention as A

ATOL = 2e-5   # |native - reference| on N(0, 1) inputs, D <= 256: measured <= 3e-6
needs_attn = native.needs(A.native_attention_available(), "the native attention kernel")
ISAS = A.attention_isas() or ["none"]
RULES = [("full", 0), ("sliding", 37), ("chunked", 50)]


def rand_qkv(Hq, Hk, T, S, D, seed=0, strided_q=False):
    g = torch.Generator().manual_seed(seed)
    if strided_q:   # like the families: qkv [T, H, D] viewed as [H, T, D]
        q = torch.randn(T, Hq, D, generator=g).transpose(0, 1)
    else:
        q = torch.randn(Hq, T, D, generator=g)
    return q, torch.randn(Hk, S, D, generator=g), torch.randn(Hk, S, D, generator=g)


def lo(kind, span, p):
    return 0 if kind == "full" else max(0, p - span + 1) if kind == "sliding" else (p // span) * span


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES)
@pytest.mark.parametrize("T", [1, 100])
@pytest.mark.parametrize("heads,D", [((6, 2), 64), ((4, 4), 20), ((4, 1), 256)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_native_matches_reference(isa, kind, span, T, heads, D, softcap):
    Hq, Hk = heads
    S = 230
    q, k, v = rand_qkv(Hq, Hk, T, S, D, seed=T + D, strided_q=True)
    q0 = S - T
    k0 = lo(kind, span, q0)          # the keys a cache would hand this call
    k, v = k[:, k0:], v[:, k0:]
    got = A.attend(q, k, v, q0, k0, kind, span, 0.3, softcap, isa=isa)
    want = A.reference(q, k, v, q0, k0, kind, span, 0.3, softcap)
    assert got.shape == (T, Hq * D) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < ATOL


def calls(kind, span, q, k, v, a, b, chunk, isa, front=0):
    """Rows of the queries at [a, b), computed in calls of ``chunk`` queries over the keys a cache
    would hold for each call ([lo(first query), last query]); ``front`` extra invisible keys before."""
    out = []
    for t0 in range(a, b, chunk):
        t1 = min(b, t0 + chunk)
        k0 = max(0, lo(kind, span, t0) - front)
        out.append(A.attend(q[:, t0:t1], k[:, k0:t1], v[:, k0:t1], t0, k0, kind, span, 0.125, isa=isa))
    return torch.cat(out)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES + [("sliding", 64), ("chunked", 64), ("sliding", 1)])
def test_rows_do_not_depend_on_chunking_or_key_range(isa, kind, span):
    Hq, Hk, D, P = 6, 2, 64, 300
    q, k, v = rand_qkv(Hq, Hk, P, P, D, seed=7, strided_q=True)
    a, b = 150, 260
    whole = A.attend(q, k, v, 0, 0, kind, span, 0.125, isa=isa)[a:b]   # every query, keys from 0
    assert torch.equal(calls(kind, span, q, k, v, a, b, b - a, isa), whole)   # just [a, b)
    for chunk in (1, 7, 64):
        assert torch.equal(calls(kind, span, q, k, v, a, b, chunk, isa), whole), chunk
    assert torch.equal(calls(kind, span, q, k, v, a, b, 7, isa, front=45), whole)
    # contiguous copies (other strides) and one thread instead of two
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = A.attend(q.contiguous(), k.clone(), v.clone(), 0, 0, kind, span, 0.125, isa=isa)[a:b]
        torch.set_num_threads(2)
        two = A.attend(q, k, v, 0, 0, kind, span, 0.125, isa=isa)[a:b]
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, whole) and torch.equal(two, whole)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES)
def test_only_visible_keys_matter(isa, kind, span):
    """Changing a key a query may not see leaves its row bit-identical; changing one it sees does
    not (the invariance checks above can fail)."""
    Hq, Hk, D, P = 4, 2, 32, 200
    q, k, v = rand_qkv(Hq, Hk, P, P, D, seed=3)
    p = 170
    base = A.attend(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], p, 0, kind, span, 0.2, isa=isa)
    first = lo(kind, span, p)
    if first > 0:
        k2, v2 = k.clone(), v.clone()
        k2[:, :first] = 100.0
        v2[:, :first] = -7.0
        assert torch.equal(A.attend(q[:, p:p + 1], k2[:, :p + 1], v2[:, :p + 1], p, 0, kind, span, 0.2, isa=isa), base)
    v3 = v.clone()
    v3[:, p - 1] += 1e-3
    assert not torch.equal(A.attend(q[:, p:p + 1], k[:, :p + 1], v3[:, :p + 1], p, 0, kind, span, 0.2, isa=isa), base)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES)
@pytest.mark.parametrize("T", [1, 100])
def test_sinks_native_matches_reference_and_stay_invariant(isa, kind, span, T):
    """Sinks join the denominator: native vs reference within ATOL (sinks above and below the
    scores' max, so both branches of the rescale run), they change the rows, and the rows of
    [a, b) stay bit-identical whatever the chunking and the key range."""
    assert A.native_sinks_available()
    Hq, Hk, D, S = 6, 2, 64, 230
    q, k, v = rand_qkv(Hq, Hk, S, S, D, seed=11, strided_q=True)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0, 9.0, -30.0])
    q0 = S - T
    k0 = lo(kind, span, q0)
    got = A.attend(q[:, q0:], k[:, k0:], v[:, k0:], q0, k0, kind, span, 0.3, isa=isa, sinks=sinks)
    want = A.reference(q[:, q0:], k[:, k0:], v[:, k0:], q0, k0, kind, span, 0.3, sinks=sinks)
    assert (got - want).abs().max().item() < ATOL
    plain = A.attend(q[:, q0:], k[:, k0:], v[:, k0:], q0, k0, kind, span, 0.3, isa=isa)
    assert (got - plain).abs().max().item() > 1e-2
    whole = A.attend(q, k, v, 0, 0, kind, span, 0.3, isa=isa, sinks=sinks)[150:200]
    for chunk in (1, 7, 50):
        out = []
        for t0 in range(150, 200, chunk):
            t1 = min(200, t0 + chunk)
            k1 = lo(kind, span, t0)
            out.append(A.attend(q[:, t0:t1], k[:, k1:t1], v[:, k1:t1], t0, k1, kind, span, 0.3, isa=isa,
                                sinks=sinks))
        assert torch.equal(torch.cat(out), whole), chunk


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sinks", [False, True])
def test_many_spans_in_one_call_equal_each_span_alone(isa, sinks):
    """attend_many (one native call for a batch of sequences): every span's rows are bit-identical
    to ``attend`` on that span alone, whatever the other spans are (kinds, lengths, decode rows of
    one query, a prefill chunk, strided q), on every ISA path."""
    assert A.native_many_available()
    Hq, Hk, D = 6, 2, 64
    sink = torch.tensor([-3.0, 0.0, 1.5, 4.0, 9.0, -30.0]) if sinks else None
    cases = [("full", 0, 1, 300), ("sliding", 37, 1, 90), ("chunked", 50, 20, 130), ("full", 0, 64, 64),
             ("sliding", 37, 1, 5), ("full", 0, 1, 1)]
    qs, ks, vs, q0s, k0s, kinds, spans, alone = [], [], [], [], [], [], [], []
    for j, (kind, span, T, S) in enumerate(cases):
        q, k, v = rand_qkv(Hq, Hk, S, S, D, seed=20 + j, strided_q=True)
        q0 = S - T
        k0 = lo(kind, span, q0)
        qs.append(q[:, q0:]), ks.append(k[:, k0:]), vs.append(v[:, k0:])
        q0s.append(q0), k0s.append(k0), kinds.append(kind), spans.append(span)
        alone.append(A.attend(q[:, q0:], k[:, k0:], v[:, k0:], q0, k0, kind, span, 0.3, softcap=None, isa=isa,
                              sinks=sink))
    got = A.attend_many_native(qs, ks, vs, q0s, k0s, kinds, spans, 0.3, isa=isa, sinks=sink)
    assert torch.equal(got, torch.cat(alone))
    # one span is the plain call; other spans' presence changes nothing
    assert torch.equal(A.attend_many_native(qs[2:3], ks[2:3], vs[2:3], q0s[2:3], k0s[2:3], kinds[2:3], spans[2:3],
                                            0.3, isa=isa, sinks=sink), alone[2])


def kv_as(k, v, dtype):
    """K/V stored as ``dtype`` (int8: quantized with row scales, K spread wider) -> (k, v, scales)."""
    if dtype != torch.int8:
        return k.to(dtype), v.to(dtype), None
    from turnkv.cache.storage import quantize_int8

    (k, ks), (v, vs) = quantize_int8(k * 3), quantize_int8(v)
    return k, v, (ks, vs)


@contextlib.contextmanager
def kernel_setting(setter, value: int):
    """A ``torch.ops.turnkv_attn.set_*`` setting for the block, the previous value restored after."""
    before = setter(value)
    try:
        yield
    finally:
        setter(before)


def max_group(g: int):
    return kernel_setting(torch.ops.turnkv_attn.set_max_group, g)


def tile(n: int):
    return kernel_setting(torch.ops.turnkv_attn.set_tile, n)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (6, 2), (4, 4)])
@pytest.mark.parametrize("D", [64, 80, 256])
def test_query_heads_sharing_kv_loads_change_no_bit(isa, heads, D):
    """The query heads of one kv head run as a group that loads each key and value row once
    (decode reads the KV once per kv head, not once per query head). Each head's arithmetic is
    its own: one head at a time (set_max_group(1)) gives the same bits, for decode rows and a
    prefill chunk, every rule, softcap and sinks, and in attend_many."""
    Hq, Hk = heads
    q, k, v = rand_qkv(Hq, Hk, 150, 150, D, seed=7, strided_q=True)
    sinks = torch.linspace(-2.0, 3.0, Hq)
    for kind, span in RULES:
        for T, softcap, sink in ((1, None, None), (20, 30.0, None), (1, None, sinks), (3, None, None)):
            q0 = 150 - T
            args = (q[:, q0:], k, v, q0, 0, kind, span, 0.2, softcap)
            grouped = A.attend(*args, isa=isa, sinks=sink)
            with max_group(1):
                single = A.attend(*args, isa=isa, sinks=sink)
            assert torch.equal(grouped, single), (kind, T, softcap, sink is not None)
    qs, ks, vs = [q[:, 149:], q[:, 100:]], [k, k[:, 20:]], [v, v[:, 20:]]
    many = lambda: A.attend_many_native(qs, ks, vs, [149, 100], [0, 20], ["full", "sliding"], [0, 80], 0.2,  # noqa: E731
                                        isa=isa)
    grouped = many()
    with max_group(1):
        assert torch.equal(many(), grouped)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("D", [64, 80, 256])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (4, 2)])
def test_queries_walking_key_blocks_together_change_no_bit(isa, dtype, D, heads):
    """A unit takes up to 16 consecutive queries that walk the key blocks together (each block's
    K/V rows read once from memory for the tile, not once per query); each query's arithmetic is
    its own (two queries that see the same keys of a block also share its P.V pass: AVX-512, and AVX2
    for groups of up to 3 heads):
    one query per unit (set_tile(1)) and odd tiles give the same bits, for prefill chunks
    whose queries see different key ranges (causal, a window or chunk boundary inside the tile),
    softcap, sinks, every K/V type and attend_many; groups of 3, 1 and 2 query heads a kv head."""
    Hq, Hk = heads
    q, k, v = rand_qkv(Hq, Hk, 300, 300, D, seed=11, strided_q=True)
    k, v, scales = kv_as(k, v, dtype)
    sinks = torch.linspace(-1.0, 2.0, Hq)
    for kind, span in RULES:
        for T, softcap, sink in ((70, None, None), (33, 30.0, None), (16, None, sinks), (5, None, None)):
            q0 = 300 - T
            call = lambda: A.attend_native(q[:, q0:], k, v, q0, 0, kind, span, 0.2, softcap, isa=isa,  # noqa: E731
                                           sinks=sink, scales=scales)
            with tile(1):
                alone = call()
            for n in (16, 3):
                with tile(n):
                    assert torch.equal(call(), alone), (kind, T, n)
    if scales is None:
        qs, ks_, vs_ = [q[:, 299:], q[:, 200:], q[:, 250:280]], [k, k[:, 20:], k], [v, v[:, 20:], v]
        many = lambda: A.attend_many_native(qs, ks_, vs_, [299, 200, 250], [0, 20, 0],  # noqa: E731
                                            ["full", "sliding", "chunked"], [0, 80, 50], 0.2, isa=isa)
        with tile(1):
            alone = many()
        assert torch.equal(many(), alone)


def split(n: int):
    return kernel_setting(torch.ops.turnkv_attn.set_split, n)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((4, 1), 256), ((8, 2), 80)])
def test_decode_rows_split_over_threads_change_no_bit(isa, dtype, heads, D):
    """A decode step of one or two sequences has fewer units than threads x 2, so the threads
    split each unit's key blocks and fold the blocks' partials afterwards in increasing position.
    The bits are the unsplit unit's: never splitting (set_split(0)), always splitting
    (set_split(64)) and one thread give equal rows, for decode rows and short chunks over
    hundreds of keys, every rule, softcap, sinks, int8 K/V with scales and attend_many; and a
    decode row equals the same query's row inside a 64-query prefill call (never split)."""
    Hq, Hk = heads
    q, k, v = rand_qkv(Hq, Hk, 700, 700, D, seed=5, strided_q=True)
    k, v, scales = kv_as(k, v, dtype)
    sinks = torch.linspace(-1.0, 2.0, Hq)
    with threads(2):
        for kind, span in RULES + [("sliding", 300)]:
            for T, softcap, sink in ((1, None, None), (1, 30.0, sinks), (2, None, None), (3, 20.0, None)):
                q0 = 700 - T
                call = lambda: A.attend_native(q[:, q0:], k, v, q0, 0, kind, span, 0.2, softcap, isa=isa,  # noqa: E731
                                               sinks=sink, scales=scales)
                with split(0):
                    whole = call()
                with split(64):
                    assert torch.equal(call(), whole), (kind, span, T)
                assert torch.equal(call(), whole), (kind, span, T)
                with threads(1):
                    assert torch.equal(call(), whole), (kind, span, T)
                if T == 1 and softcap is None:   # the same query among 64 (tiles, no split)
                    prefill = A.attend_native(q[:, 636:], k, v, 636, 0, kind, span, 0.2, isa=isa, scales=scales)
                    assert torch.equal(prefill[-1:], whole), (kind, span)
        if scales is None:
            qs, ks_, vs_ = [q[:, 699:], q[:, 400:401]], [k, k[:, 20:]], [v, v[:, 20:]]
            many = lambda: A.attend_many_native(qs, ks_, vs_, [699, 400], [0, 20], ["full", "sliding"],  # noqa: E731
                                                [0, 250], 0.2, isa=isa)
            with split(0):
                whole = many()
            with split(64):
                assert torch.equal(many(), whole)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((4, 1), 256)])
def test_prefetch_placement_changes_no_bit(isa, dtype, heads, D):
    """Where the next key block's prefetches go (set_spread: 1 spread over the P.V pass, 0 in
    bursts with each chunk of scores, -1 by row size; the default differs by CPU kind) moves no
    bit: decode rows split over threads, a short chunk and a prefill tile, over 900 keys."""
    Hq, Hk = heads
    q, k, v = rand_qkv(Hq, Hk, 900, 900, D, seed=11, strided_q=True)
    k, v, scales = kv_as(k, v, dtype)
    with threads(2):
        for kind, span in RULES:
            for T in (1, 3, 64):
                q0 = 900 - T
                call = lambda: A.attend_native(q[:, q0:], k, v, q0, 0, kind, span, 0.2, isa=isa,  # noqa: E731
                                               scales=scales)
                with spread(-1):
                    want = call()
                for v_ in (0, 1):
                    with spread(v_):
                        assert torch.equal(call(), want), (kind, span, T, v_)


def spread(v: int):
    return kernel_setting(torch.ops.turnkv_attn.set_spread, v)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 72, 256])
def test_half_kv_read_as_stored_equals_widened_float32(isa, dtype, D):
    """``--kv-cache-mode fp16 / bf16`` storage goes to the kernel as stored: it widens each K/V
    element on load (exactly), so the result is the float32 kernel's on the widened K/V bit for
    bit (every rule, decode and prefill rows, sinks, attend_many), with no per-call conversion."""
    Hq, Hk = 6, 2
    q, k, v = rand_qkv(Hq, Hk, 150, 150, D, seed=9, strided_q=True)
    kh, vh = k.to(dtype), v.to(dtype)
    assert A.native_ok(q, kh, vh) == (isa != "scalar" or A.attention_isas()[-1] != "scalar")
    sinks = torch.linspace(-1.0, 2.0, Hq)
    for kind, span in RULES:
        for T, sink in ((1, None), (17, None), (1, sinks)):
            q0 = 150 - T
            half = A.attend(q[:, q0:], kh, vh, q0, 0, kind, span, 0.2, isa=isa, sinks=sink)
            wide = A.attend(q[:, q0:], kh.float(), vh.float(), q0, 0, kind, span, 0.2, isa=isa, sinks=sink)
            assert torch.equal(half, wide), (kind, T)
    got = A.attend_many_native([q[:, 149:], q[:, 100:]], [kh, kh[:, 20:]], [vh, vh[:, 20:]], [149, 100], [0, 20],
                               ["full", "sliding"], [0, 80], 0.2, isa=isa)
    want = A.attend_many_native([q[:, 149:], q[:, 100:]], [kh.float(), kh[:, 20:].float()],
                                [vh.float(), vh[:, 20:].float()], [149, 100], [0, 20], ["full", "sliding"], [0, 80],
                                0.2, isa=isa)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_half_kv_cache_hands_the_kernel_its_storage(mode):
    """A fp16 / bf16 KV cache's view carries the stored half tensors (no float32 copy per call)
    and converts them only when a reader asks for ``keys`` / ``values``."""
    cache = KVCache(2, 64, torch.float32, "cpu", mode=mode)
    k, v = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    view = cache.update_and_fetch(k, v)
    want = torch.float16 if mode == "fp16" else torch.bfloat16
    assert view.stored is not None and view.stored[0].dtype == want and view.key_count == 10
    assert view._keys is None                                  # nothing converted yet
    assert torch.equal(view.keys, k.to(want).float()) and view.keys.dtype == torch.float32
    native = KVCache(2, 64, torch.float32, "cpu").update_and_fetch(k, v)
    assert native.stored is None and torch.equal(native.keys, k)


@needs_attn
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES)
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((4, 1), 256), ((6, 2), 40), ((2, 2), 7)])
def test_int8_kv_read_as_stored_equals_the_dequantized_copy(isa, kind, span, heads, D):
    """--kv-cache-mode int8: the kernel reads the int8 values with their float16 row scales and
    multiplies them on load (exact in float32), so every row is bit-identical to the kernel on a
    dequantized float32 copy: decode, a prefill chunk, softcap, one query or several. The scalar
    path, which reads float32 only, gets the same values widened in Python (``_widen``)."""
    from turnkv.cache.storage import dequantize_int8, quantize_int8

    if not A.native_ok(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8, dtype=torch.int8),
                       torch.zeros(1, 1, 8, dtype=torch.int8), None, True):
        pytest.skip("this build does not read int8 K/V")
    Hq, Hk = heads
    for T, S, cap in ((1, 300, None), (40, 170, None), (3, 90, 25.0)):
        q, k, v = rand_qkv(Hq, Hk, T, S, D, seed=T + D, strided_q=True)
        kq, ks = quantize_int8(k * 3)
        vq, vs = quantize_int8(v)
        q0 = S - T
        k0 = lo(kind, span, q0)
        got = A.attend_native(q, kq[:, k0:], vq[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa,
                              scales=(ks[:, k0:], vs[:, k0:]))
        want = A.attend_native(q, dequantize_int8(kq, ks, torch.float32)[:, k0:],
                               dequantize_int8(vq, vs, torch.float32)[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa)
        assert torch.equal(got, want), (T, S)
        many = A.attend_many_native([q, q[:, :1]], [kq[:, k0:], kq[:, :S - T + 1]], [vq[:, k0:], vq[:, :S - T + 1]],
                                    [q0, q0], [k0, 0], [kind, "full"], [span, 0], 0.2, cap, isa=isa,
                                    scales=[(ks[:, k0:], vs[:, k0:]), (ks[:, :S - T + 1], vs[:, :S - T + 1])])
        assert torch.equal(many[:T], want)


def test_int8_kv_cache_hands_the_kernel_its_storage():
    """An int8 KV cache's view carries the int8 values and their scales (no float32 copy per call)
    and dequantizes only when a reader asks for ``keys`` / ``values``."""
    from turnkv.cache.storage import dequantize_int8

    cache = KVCache(2, 64, torch.float32, "cpu", mode="int8")
    k, v = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    view = cache.update_and_fetch(k, v)
    assert view.stored[0].dtype == torch.int8 and view.scales[0].dtype == torch.float16 and view._keys is None
    assert torch.equal(view.keys, dequantize_int8(view.stored[0], view.scales[0], torch.float32))
    assert (view.keys - k).abs().max() < 0.05


def make_cache(kind):
    if kind == "full":
        return KVCache(2, 32)
    if kind == "sliding":
        return SlidingWindowCache(2, 32, window=40, slack=8, block_size=8)
    return ChunkedCache(2, 32, chunk=48, block_size=8)


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
def test_cache_view_native_equals_sdpa_fallback(kind, monkeypatch):
    """models.base.attention on a cache's KVView: the native kernel (when built) and the SDPA path
    with the view's mask agree with the reference within float32 rounding; decode builds no mask."""
    from turnkv.models import base

    g = torch.Generator().manual_seed(1)
    cache = make_cache(kind)
    pos = 0
    for T in (70, 1, 33, 1, 64, 1):
        q = torch.randn(6, T, 32, generator=g)
        view = cache.update_and_fetch(torch.randn(2, T, 32, generator=g), torch.randn(2, T, 32, generator=g))
        assert view.query_pos0 == pos and view.queries == T and view.kind == kind
        assert view.key_pos0 + view.keys.shape[1] == pos + T
        got = base.attention(q, view, 0.17)
        if A.native_attention_available() or T == 1:
            assert view._mask is None      # the native path (or a decode) never builds the mask
        if T == 1:
            assert view.mask is None
        want = A.reference(q, view.keys, view.values, pos, view.key_pos0, kind, view.span, 0.17)
        assert (got - want).abs().max().item() < ATOL
        with monkeypatch.context() as m:   # the SDPA fallback (bf16, CUDA, no build) on the same view
            m.setattr(base, "native_attention_ok", lambda *a: False)
            sdpa = base.attention(q, view, 0.17)
            assert (sdpa - want).abs().max().item() < ATOL
            assert (view.mask is None) == (T == 1)
        pos += T


def _span_batch(caches_list, lengths):
    """A Batch over one cache list per span (only the fields attention_spans reads)."""
    from turnkv.models.batch import Batch
    return Batch.build([(torch.zeros(n, dtype=torch.long), c, "none") for c, n in zip(caches_list, lengths)])


@needs_attn
@pytest.mark.parametrize("mode", ["native", "fp16", "bf16", "int8"])
def test_write_attend_equals_cache_update_then_attend(mode, monkeypatch):
    """attention_spans' one-call path (the kernel writes each span's K/V into its cache buffers,
    int8 ones quantized as quantize_int8 does, then attends) against the cache's own
    update_and_fetch + attend, step by step on two copies of the same caches (full, sliding with
    blocks released as the window moves, chunked; prefill chunks beside decode rows, pools that grow): the outputs and
    every stored K/V row (and int8 scale) are bit-identical."""
    from turnkv.models import base

    want_dtype = torch.int8 if mode == "int8" else torch.float32
    if not A.write_buffers_ok([want_dtype]):
        pytest.skip("this build has no write_attend for this mode")

    def caches():
        # one block pool for the three (as the layer of a batch has): their blocks interleave, so
        # the kernel reads and writes through block tables that are not runs
        pool = BlockPool(mode, 2, 32, torch.float32, "cpu")
        return [KVCache(2, 32, mode=mode, pool=pool),
                SlidingWindowCache(2, 32, window=40, slack=8, mode=mode, pool=pool),
                ChunkedCache(2, 32, chunk=48, mode=mode, pool=pool)]
    fast, slow = caches(), caches()
    g = torch.Generator().manual_seed(3)
    called = []
    real = base.write_attend_plan
    monkeypatch.setattr(base, "write_attend_plan", lambda *a, **k: called.append(1) or real(*a, **k))
    for lens in ([70, 1, 33], [1, 1, 1], [33, 64, 1], [1, 300, 1], [1, 1, 64], [5, 1, 1], [130, 1, 70]):
        R = sum(lens)
        qkv = torch.randn(R, 6 + 2 + 2, 32, generator=g).transpose(0, 1)   # [H, R, D] strided like the families
        q, k, v = qkv[:6], qkv[6:8], qkv[8:]
        got = base.attention_spans(_span_batch([[c] for c in fast], lens), 0, q, k, v, 0.17)
        with monkeypatch.context() as m:
            m.setattr(base, "write_attend_ok", lambda *a, **kw: False)
            want = base.attention_spans(_span_batch([[c] for c in slow], lens), 0, q, k, v, 0.17)
        assert torch.equal(got, want), lens
        for a, b in zip(fast, slow):
            assert (a.offset, a.floor, len(a.block_ids())) == (b.offset, b.floor, len(b.block_ids()))
            ea, eb = a.export(a.floor, a.offset), b.export(b.floor, b.offset)
            assert set(ea) == set(eb) == set(a.store.parts)
            for name in ea:
                assert torch.equal(ea[name], eb[name]), name
    assert len(called) == 7
    ids = [b for c in fast for b in c.block_ids()]
    assert len(set(ids)) == len(ids) and any(b - a != 1 for a, b in zip(ids, ids[1:]))


@needs_attn
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_attend_rounds_like_copy(dtype):
    """The kernel's float32 -> float16 / bfloat16 stores round as ``copy_`` does, on values that
    sit exactly half-way between two neighbours, subnormals, overflow and signed zeros."""
    if not A.write_buffers_ok([dtype]):
        pytest.skip("write_attend does not take this dtype here")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4096, generator=g) * torch.logspace(-9, 6, 4096)
    h = x.to(dtype).float()
    # ties: midpoints between neighbouring representable values
    nxt = torch.nextafter(x.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float()
    special = torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e5, -1e5, 6e-8, 3e-8, 1e-40, float("inf"), float("-inf")])
    vals = torch.cat([x, (h + nxt) / 2, special])
    n = vals.numel() // 64 * 64
    k = vals[:n].view(1, -1, 64)
    R, B = k.shape[1], A.KERNEL_BLOCK
    nb = -(-(R + 3) // B)
    buf_k, buf_v = torch.zeros(1, (nb + 1) * B, 64, dtype=dtype), torch.zeros(1, (nb + 1) * B, 64, dtype=dtype)
    table = torch.tensor([nb] + list(range(nb - 1)), dtype=torch.int32)    # block 0 in the pool's last
    q = torch.zeros(1, R, 64)
    A.write_attend(q, k, k, [buf_k], [buf_v], [R], [table], [3], [0], ["full"], [0], 0.1)
    pos = torch.arange(3, R + 3)
    rows = table.long()[pos // B] * B + pos % B
    assert torch.equal(buf_k[:, rows], k.to(dtype)) and torch.equal(buf_v[:, rows], k.to(dtype))


@needs_attn
def test_write_attend_quantizes_int8_like_quantize_int8():
    """The kernel's int8 stores equal cache.storage.quantize_int8 on rows with exact .5 quotients,
    all-zero rows (the scale's lower clamp), huge rows (its upper clamp) and tiny ones."""
    from turnkv.cache.storage import quantize_int8

    if not A.write_buffers_ok([torch.int8]):
        pytest.skip("this build has no int8 write_attend")
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(64, generator=g) * 10 ** e for e in range(-9, 7)]
    rows += [torch.zeros(64), torch.full((64,), 1e9), torch.arange(64.0) - 31.5,
             torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 58)]
    k = torch.stack(rows)[None]                       # [1, R, 64]
    R, B = k.shape[1], A.KERNEL_BLOCK
    buf_k, buf_v = torch.zeros(1, 2 * B, 64, dtype=torch.int8), torch.zeros(1, 2 * B, 64, dtype=torch.int8)
    sk, sv = torch.zeros(1, 2 * B, 1, dtype=torch.float16), torch.zeros(1, 2 * B, 1, dtype=torch.float16)
    A.write_attend(torch.zeros(1, R, 64), k, -k, [buf_k], [buf_v], [R], [torch.tensor([1], dtype=torch.int32)],
                   [0], [0], ["full"], [0], 0.1, kscales=[sk], vscales=[sv])
    qk, s_k = quantize_int8(k)
    qv, s_v = quantize_int8(-k)
    at = slice(B, B + R)                              # block 0 of the sequence is the pool's block 1
    assert torch.equal(buf_k[:, at], qk) and torch.equal(sk[:, at], s_k)
    assert torch.equal(buf_v[:, at], qv) and torch.equal(sv[:, at], s_v)


@needs_attn
@pytest.mark.parametrize("kind,wc", [("full", 0), ("sliding", 40), ("chunked", 48)])
def test_write_attend_through_scrambled_tables_equals_attend_on_every_path(kind, wc):
    """Every ISA path (scalar included) reads and writes K/V through a block table that is not a
    run, int8 widening included, with the same bits as ``attend_native`` on the same keys laid out
    contiguously."""
    B, g = A.KERNEL_BLOCK, torch.Generator().manual_seed(9)
    old, new = 150, 40                                # 150 positions stored, then a chunk of 40
    blocks = -(-(old + new) // B)
    perm = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)
    keys, vals = torch.randn(2, old + new, 32, generator=g), torch.randn(2, old + new, 32, generator=g)
    q = torch.randn(6, new, 32, generator=g)
    pos = torch.arange(old)
    rows = perm.long()[pos // B] * B + pos % B
    first = 0 if kind == "full" else max(0, old - wc + 1) if kind == "sliding" else (old // wc) * wc
    for isa in A.attention_isas():
        for int8 in ((False, True) if isa != "scalar" and A.write_buffers_ok([torch.int8]) else (False,)):
            kb = torch.zeros(2, (blocks + 2) * B, 32, dtype=torch.int8 if int8 else torch.float32)
            vb = torch.zeros_like(kb)
            ks = vs = None
            if int8:
                from turnkv.cache.storage import quantize_int8
                ks, vs = (torch.zeros(2, (blocks + 2) * B, 1, dtype=torch.float16) for _ in range(2))
                (kq, sk), (vq, sv) = quantize_int8(keys[:, :old]), quantize_int8(vals[:, :old])
                kb[:, rows], vb[:, rows], ks[:, rows], vs[:, rows] = kq, vq, sk, sv
            else:
                kb[:, rows], vb[:, rows] = keys[:, :old], vals[:, :old]
            got = A.write_attend(q, keys[:, old:], vals[:, old:], [kb], [vb], [new], [perm], [old], [first], [kind],
                                 [wc], 0.2, isa=isa, kscales=[ks] if int8 else None, vscales=[vs] if int8 else None)
            at = perm.long()[torch.arange(first, old + new) // B] * B + torch.arange(first, old + new) % B
            if int8:
                want = A.attend_native(q, kb[:, at], vb[:, at], old, first, kind, wc, 0.2, isa=isa,
                                       scales=(ks[:, at], vs[:, at]))
            else:
                want = A.attend_native(q, keys[:, first:], vals[:, first:], old, first, kind, wc, 0.2, isa=isa)
            assert torch.equal(got, want), (isa, int8)


@needs_attn
def test_write_attend_rejects_blocks_outside_the_pool():
    q, k, v = torch.zeros(2, 4, 32), torch.zeros(1, 4, 32), torch.zeros(1, 4, 32)
    buf = torch.zeros(1, A.KERNEL_BLOCK, 32)           # a pool of one block
    if not (A.write_attend_ok(q, k, v) and A.write_buffers_ok([torch.float32])):
        pytest.skip("this build has no write_attend")
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        A.write_attend(q, k, v, [buf], [buf.clone()], [4], [torch.tensor([1], dtype=torch.int32)], [0], [0],
                       ["full"], [0], 0.1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        A.write_attend(q, k, v, [buf], [buf.clone()], [4], [torch.tensor([-1], dtype=torch.int32)], [0], [0],
                       ["full"], [0], 0.1)
    with pytest.raises(RuntimeError, match="ends before"):
        A.write_attend(q, k, v, [buf], [buf.clone()], [4], [one], [A.KERNEL_BLOCK - 2], [0], ["full"], [0], 0.1)
    with pytest.raises(RuntimeError, match="out of range"):
        A.write_attend(q, k, v, [buf], [buf.clone()], [4], [one], [0], [3], ["full"], [0], 0.1)
    with pytest.raises(RuntimeError, match="add up"):
        A.write_attend(q, k, v, [buf], [buf.clone()], [3], [one], [0], [0], ["full"], [0], 0.1)


# ------------------------------------------------------------------ bundled models, gguf weights

TEXT = Path(__file__).resolve().parents[1] / "turnkv" / "data" / "coriolanus.txt"


@pytest.fixture(scope="module", params=[("smollm2-135m", 400, 330), ("gemma3-270m", 600, 550)],
                ids=["smollm2", "gemma3"])
def gguf_model(request):
    from turnkv import kernels
    from turnkv.engine.engine import Engine

    if not kernels.native_available() or not A.native_attention_available():
        native.missing("the native kernels")
    name, n, split = request.param
    try:
        eng = Engine.load(name, weights="gguf", progress=False)
    except Exception as e:  # noqa: BLE001 - the model package is not installed
        pytest.skip(f"{name}: {e}")
    ids = torch.tensor(eng.tokenizer.encode(TEXT.read_text())[:n])
    assert ids.shape[0] == n
    return eng.model, ids, split


def prefill(model, ids, sizes, caches=None, start=0, other=None, mode=None):
    """Logits of every token of ids[start:], fed in chunks of ``sizes``; ``other``: (tokens,
    caches) of another sequence that shares every forward (5 tokens of it per step)."""
    from turnkv.cache.specs import make_caches
    from turnkv.models.batch import Batch

    if caches is None:
        specs = model.cache_specs()
        caches = make_caches(specs, torch.float32, modes=None if mode is None else [mode] * len(specs))
    outs, a, j = [], start, 0
    while a < ids.shape[0]:
        n = min(sizes, ids.shape[0] - a)
        parts = [(ids[a:a + n], caches, "all")]
        if other is not None:
            parts.append((other[0][j:j + 5], other[1], "last"))
            j += 5
        out = model.forward(Batch.build(parts))
        outs.append(out[:n])
        a += n
    return torch.cat(outs), caches


@pytest.mark.real
def test_gguf_logits_bit_identical_across_chunking_reuse_and_batching(gguf_model):
    from turnkv.cache.specs import make_caches

    model, ids, split = gguf_model
    n = ids.shape[0]
    torch.set_num_threads(1)   # robust to a busy 2-core machine (conftest restores); the kernels
    #                            split work over threads without changing a row's arithmetic
    with torch.inference_mode():
        whole, _ = prefill(model, ids, n)
        chunked, _ = prefill(model, ids, 64)
        # a cache hit: the first ``split`` tokens, snapshotted, restored into fresh caches, then the rest
        head, caches = prefill(model, ids[:split], split)
        snaps = [c.snapshot() for c in caches]
        fresh = make_caches(model.cache_specs(), torch.float32)
        for c, s in zip(fresh, snaps):
            c.restore(s)
        tail, _ = prefill(model, ids, n, caches=fresh, start=split)
        other = (ids.flip(0)[: 5 * (n // 64 + 1)], make_caches(model.cache_specs(), torch.float32))
        batched, _ = prefill(model, ids, 64, other=other)
    assert torch.equal(chunked, whole)
    assert torch.equal(torch.cat([head, tail]), whole)
    assert torch.equal(batched, whole)


@pytest.mark.real
def test_gguf_logits_bit_identical_across_chunking_with_int4_kv(gguf_model):
    """Quantized KV (``--kv-cache-mode int4``): the K/V stored for a token no longer picks up
    float noise from the chunking, so one chunk and chunks of 64 still give the same bits."""
    model, ids, _ = gguf_model
    torch.set_num_threads(1)
    with torch.inference_mode():
        whole, _ = prefill(model, ids, ids.shape[0], mode="int4")
        chunked, _ = prefill(model, ids, 64, mode="int4")
    assert torch.equal(chunked, whole)


def test_numerics_tag_names_the_attention_path(monkeypatch):
    """Snapshots are named by the kernels' numerics (Engine.load's fingerprint): the ISA paths round
    differently, so each path, the reference and each arithmetic version get their own tag."""
    tags = set()
    for op, default in ((None, -1), ("native", 0), ("native", 1), ("native", 2)):
        monkeypatch.setattr(A, "_op", op)
        monkeypatch.setattr(A, "_default", default)
        tags.add(A.numerics_tag())
    monkeypatch.setattr(A, "NUMERICS", A.NUMERICS + 1)
    tags.add(A.numerics_tag())
    assert len(tags) == 5
