"""int4 K/V (``--kv-cache-mode int4``) read by the native attention kernel from their packed rows.

The kernel's units widen the packed nibbles and their float16 group scales to float32 a key block
at a time, keys' rotation undone on the integers, exactly as ``cache.storage.dequantize_int4`` does, so every output
row is the bits of the kernel on a dequantized float32 copy (which is what an int4 layer computed
before: chunk-invariance and reuse == cold carry over unchanged), on every ISA path, in decode and
prefill calls, one span or several; and an int4 cache's view hands the kernel those packed rows.
"""

from __future__ import annotations

import pytest
import torch

import native
from turnkv.cache.kv import KVCache
from turnkv.cache.storage import Int4Store, dequantize_int4, quantize_int4
from turnkv.kernels import attention as A

needs_int4 = native.needs(A.native_attention_available() and A.native_ok(
    torch.zeros(1, 1, 8), torch.zeros(1, 1, 4, dtype=torch.uint8), torch.zeros(1, 1, 4, dtype=torch.uint8), None, True),
    "the native attention kernel reading int4 K/V")
ISAS = A.attention_isas() or ["none"]
RULES = [("full", 0), ("sliding", 37), ("chunked", 50)]


def lo(kind, span, p):
    return 0 if kind == "full" else max(0, p - span + 1) if kind == "sliding" else (p // span) * span


def packed(x: torch.Tensor, which: str):
    """(packed rows, scales, float32 copy) of x [Hk, S, D] as an Int4Store stores keys or values."""
    store = Int4Store(x.shape[0], x.shape[2], torch.float32, "cpu")
    p, s = quantize_int4(x, store.groups[which], store.rotation[which])
    return p, s, dequantize_int4(p, s, torch.float32, store.rotation[which])


@needs_int4
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,span", RULES)
@pytest.mark.parametrize("heads,D", [((32, 8), 64), ((4, 1), 256), ((6, 2), 128), ((6, 2), 40), ((2, 2), 6)])
def test_int4_kv_read_as_stored_equals_the_dequantized_copy(isa, kind, span, heads, D):
    Hq, Hk = heads
    g = torch.Generator().manual_seed(D + Hq)
    for T, S, cap in ((1, 300, None), (40, 170, None), (3, 90, 25.0)):
        q = torch.randn(T, Hq, D, generator=g).transpose(0, 1)          # strided, as the families' q
        kp, ks, kf = packed(torch.randn(Hk, S, D, generator=g) * 3, "k")
        vp, vs, vf = packed(torch.randn(Hk, S, D, generator=g), "v")
        q0 = S - T
        k0 = lo(kind, span, q0)
        got = A.attend_native(q, kp[:, k0:], vp[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa,
                              scales=(ks[:, k0:], vs[:, k0:]))
        want = A.attend_native(q, kf[:, k0:], vf[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa)
        assert torch.equal(got, want), (T, S)
        many = A.attend_many_native([q, q[:, :1]], [kp[:, k0:], kp[:, :S - T + 1]], [vp[:, k0:], vp[:, :S - T + 1]],
                                    [q0, q0], [k0, 0], [kind, "full"], [span, 0], 0.2, cap, isa=isa,
                                    scales=[(ks[:, k0:], vs[:, k0:]), (ks[:, :S - T + 1], vs[:, :S - T + 1])])
        assert torch.equal(many[:T], want)


@needs_int4
def test_int4_kv_decode_row_equals_its_row_in_a_prefill_chunk():
    """The decode query's row over packed int4 K/V is the same bits as that query's row in a
    64-query call over the same keys, on 1 and 2 threads (the kernel's invariance on widened K/V)."""
    g = torch.Generator().manual_seed(3)
    Hq, Hk, D, S = 32, 8, 64, 1000
    q = torch.randn(Hq, 64, D, generator=g)
    kp, ks, _ = packed(torch.randn(Hk, S, D, generator=g), "k")
    vp, vs, _ = packed(torch.randn(Hk, S, D, generator=g), "v")
    before = torch.get_num_threads()
    try:
        rows = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            chunk = A.attend_native(q, kp, vp, S - 16, 0, "full", 0, 0.125, scales=(ks, vs))
            one = A.attend_native(q[:, -1:], kp, vp, S - 1, 0, "full", 0, 0.125, scales=(ks, vs))
            assert torch.equal(one, chunk[-1:])
            rows.append(one)
        assert torch.equal(rows[0], rows[1])
    finally:
        torch.set_num_threads(before)


def test_int4_kv_cache_hands_the_kernel_its_storage():
    """An int4 cache's view carries the packed rows and their group scales (no float32 copy per
    call) and widens them only when another reader asks for ``keys`` / ``values``."""
    cache = KVCache(2, 64, torch.float32, "cpu", mode="int4")
    k, v = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    view = cache.update_and_fetch(k, v)
    assert view.stored[0].dtype == torch.uint8 and view.stored[0].shape == (2, 10, 32) and view._keys is None
    assert view.scales[0].dtype == torch.float16 and view.scales[0].shape == (2, 10, 2)
    store = cache.store
    assert torch.equal(view.keys, dequantize_int4(view.stored[0], view.scales[0], torch.float32, store.rotation["k"]))
    assert torch.equal(view.values, dequantize_int4(view.stored[1], view.scales[1], torch.float32, 0))
    assert (view.values - v).abs().max() < 0.5
