"""KV storage modes: round-trip accuracy, stored bytes, exact payloads, snapshots and real models."""

from __future__ import annotations

import pytest
import torch

from turnkv.cache.base import KV_MODE_MISMATCH, SnapshotMismatch
from turnkv.cache.chunked import ChunkedCache
from turnkv.cache.kv import KVCache
from turnkv.cache.storage import (
    MODES,
    NATIVE,
    STORES,
    Int4Store,
    Int8Store,
    KVStore,
    effective_mode,
    fwht,
    int4_group_size,
    int4_groups,
    layer_modes,
    make_store,
    rotation,
    rotation_size,
)
from turnkv.cache.sliding import SlidingWindowCache
from turnkv.cache.specs import describe_modes, full, make_caches, recurrent

QUANTIZED = ("int8", "int4")


def kv(heads: int, T: int, head_dim: int, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, T, head_dim, generator=g) * scale
    v = torch.randn(heads, T, head_dim, generator=g) * scale
    # a few outlier channels, as real post-RoPE keys have
    k[:, :, 3] *= 8
    return k, v


def stored_bytes(payload: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.contiguous().view(torch.uint8).numpy().tobytes() for name, t in payload.items()}


def roundtrip(mode: str, x: torch.Tensor, which: str = "k", dtype=torch.float32) -> torch.Tensor:
    """x stored and read back as keys (``which="k"``) or values of a fresh store."""
    s = make_store(mode, x.shape[0], x.shape[2], dtype, "cpu", capacity=x.shape[1])
    s.write(0, x, x)
    return s.read(0, x.shape[1])[0 if which == "k" else 1]


# --- stores ------------------------------------------------------------------------------------------

def test_registry_covers_every_mode():
    assert set(STORES) == set(MODES)
    assert STORES["int8"] is Int8Store and STORES["int4"] is Int4Store
    with pytest.raises(ValueError, match="unknown KV cache mode"):
        make_store("int3", 2, 64, torch.float32, "cpu")


@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_error_is_bounded(mode, head_dim):
    k, v = kv(3, 50, head_dim)
    s = make_store(mode, 3, head_dim, torch.float32, "cpu", capacity=64)
    s.write(5, k, v)
    rk, rv = s.read(5, 55)
    assert rk.dtype == torch.float32 and rk.shape == k.shape
    for x, r in ((k, rk), (v, rv)):
        err = (r - x).abs()
        if mode == NATIVE:
            assert torch.equal(r, x)
        elif mode in ("bf16", "fp16"):
            bound = 2.0 ** -8 if mode == "bf16" else 2.0 ** -11
            assert (err <= bound * x.abs() + 1e-7).all()
        elif mode == "int8":
            # half a step of absmax / 127 per token and head
            row_max = x.abs().amax(-1, keepdim=True)
            assert (err <= row_max / 254 * 1.01).all()
            assert err.max() / x.abs().max() < 0.005
        elif x is v:
            # int4 values: at most one step (absmax / 8) of the group, usually half a step
            g = int4_groups(head_dim)["v"]
            group_max = x.abs().unflatten(-1, (head_dim // g, g)).amax(-1, keepdim=True)
            assert (err.unflatten(-1, (head_dim // g, g)) <= group_max / 8 * 1.01).all()
            assert err.mean() / x.abs().mean() < 0.1
        else:
            # int4 keys are quantized Hadamard-rotated, so the error is spread over each group;
            # the rotation keeps the outlier channel from coarsening its neighbours
            assert err.square().mean().sqrt() / x.square().mean().sqrt() < 0.09
            assert err[..., 4:].mean() / x[..., 4:].abs().mean() < 0.13


@pytest.mark.parametrize("mode", MODES)
def test_read_returns_the_compute_dtype(mode):
    k, v = kv(2, 10, 32)
    s = make_store(mode, 2, 32, torch.bfloat16, "cpu", capacity=16)
    s.write(0, k.bfloat16(), v.bfloat16())
    rk, rv = s.read(0, 10)
    assert rk.dtype == rv.dtype == torch.bfloat16
    tol = 0.02 if mode != "int4" else 0.2
    assert (rk.float() - k).abs().max() / k.abs().max() < tol


def test_quantized_rows_of_zeros_and_extremes_stay_finite():
    for mode in QUANTIZED:
        x = torch.zeros(2, 4, 64)
        x[1, 1] = 1e-30
        x[1, 2] = 3e4
        x[1, 3, 7] = -5e5
        r = roundtrip(mode, x)
        assert torch.isfinite(r).all()
        assert torch.equal(r[0], x[0])


def test_int4_group_size():
    assert [int4_group_size(d) for d in (256, 128, 64, 32, 16, 8, 80)] == [32, 32, 32, 32, 16, 8, 20]
    # wide heads: finer key groups, coarser value groups, still >= 3.5x smaller than bf16
    assert int4_groups(256) == {"k": 16, "v": 128} and int4_groups(128) == {"k": 16, "v": 128}
    assert int4_groups(64) == {"k": 32, "v": 32} and int4_groups(80) == {"k": 20, "v": 20}
    for d in (64, 128, 256):
        s = make_store("int4", 1, d, torch.float32, "cpu")
        assert 2 * d * 2 / s.bytes_per_token() >= 3.5, d
    with pytest.raises(ValueError):
        int4_group_size(63)


@pytest.mark.parametrize("mode", MODES)
def test_export_load_is_bit_exact(mode):
    k, v = kv(2, 40, 64, seed=1)
    a = make_store(mode, 2, 64, torch.float32, "cpu", capacity=64)
    a.write(0, k, v)
    payload = a.export(3, 33)
    assert all(t.shape[1] == 30 for t in payload.values())
    before = stored_bytes(payload)
    a.write(0, *kv(2, 40, 64, seed=2))            # export is a copy, not a view
    assert stored_bytes(payload) == before
    b = make_store(mode, 2, 64, torch.float32, "cpu", capacity=128)
    b.load(70, payload)
    assert stored_bytes(b.export(70, 100)) == before
    assert torch.equal(b.read(70, 100)[0], roundtrip(mode, k[:, 3:33]))


def test_quantized_payloads_keep_the_quantized_bytes():
    p8 = make_store("int8", 2, 64, torch.float32, "cpu", capacity=8)
    p8.write(0, *kv(2, 8, 64))
    assert {n: t.dtype for n, t in p8.export(0, 8).items()} == {
        "k": torch.int8, "k_scale": torch.float16, "v": torch.int8, "v_scale": torch.float16}
    p4 = make_store("int4", 2, 64, torch.float32, "cpu", capacity=8)
    p4.write(0, *kv(2, 8, 64))
    shapes = {n: (t.dtype, tuple(t.shape)) for n, t in p4.export(0, 8).items()}
    assert shapes["k"] == (torch.uint8, (2, 8, 32)) and shapes["k_scale"] == (torch.float16, (2, 8, 2))
    with pytest.raises(ValueError, match="payload"):
        p4.load(0, p8.export(0, 8))


@pytest.mark.parametrize("mode", MODES)
def test_each_token_is_stored_independently(mode):
    T = 300
    k, v = kv(3, T, 64, seed=3)
    whole = make_store(mode, 3, 64, torch.float32, "cpu", capacity=T)
    whole.write(0, k, v)
    one_by_one = make_store(mode, 3, 64, torch.float32, "cpu", capacity=T)
    for t in range(T):
        one_by_one.write(t, k[:, t:t + 1], v[:, t:t + 1])
    chunks = make_store(mode, 3, 64, torch.float32, "cpu", capacity=T)
    for a in range(0, T, 37):
        chunks.write(a, k[:, a:a + 37], v[:, a:a + 37])
    ref = stored_bytes(whole.export(0, T))
    assert stored_bytes(one_by_one.export(0, T)) == ref
    assert stored_bytes(chunks.export(0, T)) == ref
    # and reads of any range give the same values per token
    assert torch.equal(whole.read(0, T)[0][:, 100:140], whole.read(100, 140)[0])
    assert torch.equal(whole.read(0, T)[1][:, 299:], whole.read(299, 300)[1])


def test_int4_key_rotation_is_orthogonal_and_exactly_undone():
    for n in (2, 8, 32):
        signs, matrix = rotation(n, "cpu")
        assert set(signs.tolist()) <= {-1.0, 1.0} and set(matrix.unique().tolist()) == {-1.0, 1.0}
        x = torch.randn(5, n)
        rotated = fwht(x * signs, n) * n ** -0.5          # how keys are stored
        assert torch.allclose(rotated @ matrix * n ** -0.5, x, atol=1e-5)
        r = torch.diag(signs) @ matrix.T / n ** 0.5
        assert torch.allclose(r @ r.T, torch.eye(n), atol=1e-6)
    assert [rotation_size(g) for g in (32, 16, 20, 6)] == [32, 16, 4, 2]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_nbytes_shrink_by_the_expected_factor(head_dim):
    def store(mode, dtype=torch.float32):
        return make_store(mode, 4, head_dim, dtype, "cpu", capacity=512)

    f32 = store(NATIVE).nbytes
    assert f32 == 2 * 4 * head_dim * 512 * 4
    assert store("bf16").nbytes * 2 == f32 == store("fp16").nbytes * 2
    assert store(NATIVE, torch.bfloat16).nbytes * 2 == f32
    assert f32 / store("int8").nbytes >= 3.75
    assert f32 / store("int4").nbytes >= 7.0
    assert store("bf16").nbytes / store("int8").nbytes >= 1.85
    assert store("bf16").nbytes / store("int4").nbytes >= 3.5
    for mode in MODES:
        s = store(mode)
        assert s.nbytes == s.bytes_per_token() * 512
    s = store("int4")
    s.grow(1024, keep=512)
    assert s.nbytes == s.bytes_per_token() * 1024


@pytest.mark.parametrize("mode", MODES)
def test_grow_keeps_the_stored_bytes(mode):
    k, v = kv(2, 30, 64)
    s = make_store(mode, 2, 64, torch.float32, "cpu", capacity=64)
    s.write(0, k, v)
    ref = stored_bytes(s.export(10, 30))
    s.grow(256, keep=30)
    assert stored_bytes(s.export(10, 30)) == ref


# --- caches ------------------------------------------------------------------------------------------

def feed(cache, k, v, step: int):
    outs = []
    for a in range(0, k.shape[1], step):
        view = cache.update_and_fetch(k[:, a:a + step], v[:, a:a + step])
        # a view may alias the pool's blocks (valid until the cache's next write): keep copies
        outs.append((view.keys.clone(), view.values.clone(), view.mask))
    return outs


def make_cache(kind: str, mode: str):
    if kind == "full":
        return KVCache(2, 32, mode=mode, block_size=8)
    if kind == "sliding":
        return SlidingWindowCache(2, 32, window=12, slack=6, mode=mode, block_size=8)
    return ChunkedCache(2, 32, chunk=16, mode=mode, block_size=8)


def assert_same_outputs(got, want):
    for (k1, v1, m1), (k2, v2, m2) in zip(got, want, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert (m1 is None) == (m2 is None) and (m1 is None or torch.equal(m1, m2))


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
@pytest.mark.parametrize("mode", MODES)
def test_cache_kinds_work_in_every_mode(kind, mode):
    """A cache in ``mode`` returns exactly what a native cache returns for the round-tripped K/V
    (quantization is per token, so it commutes with the cache's compaction), through prefill
    chunks, decode steps and the ring wrapping."""
    k, v = kv(2, 90, 32, seed=4)
    rk, rv = roundtrip(mode, k, "k"), roundtrip(mode, v, "v")
    for step in (7, 1):
        got = feed(make_cache(kind, mode), k, v, step)
        want = feed(make_cache(kind, NATIVE), rk, rv, step)
        assert_same_outputs(got, want)
    cache = make_cache(kind, mode)
    feed(cache, k, v, 5)
    assert 0 < cache.nbytes == len(cache.block_ids()) * cache.pool.block_bytes <= cache.store.nbytes


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
@pytest.mark.parametrize("mode", QUANTIZED + ("bf16",))
def test_quantized_snapshot_restore_is_bit_exact(kind, mode):
    k, v = kv(2, 70, 32, seed=5)
    live = make_cache(kind, mode)
    feed(live, k[:, :50], v[:, :50], 9)
    snap = live.snapshot()
    held = snap.start                            # a sliding snapshot may hold less than the live ring
    ref = stored_bytes(live.export(held, live.offset))
    # snapshot parts are the stored representation, not floats
    for part in snap.parts():
        assert part.tensors["k"].dtype == live.store.parts["k"].dtype
    feed(live, k[:, 50:], v[:, 50:], 1)          # the live cache moves on (and may compact)
    fresh = make_cache(kind, mode)
    fresh.restore(snap)
    live.restore(snap)
    for c in (fresh, live):
        assert c.offset == 50 and c.floor <= held
        assert stored_bytes(c.export(held, c.offset)) == ref
    # continuing after a restore equals continuing the cold cache
    cold = make_cache(kind, mode)
    feed(cold, k[:, :50], v[:, :50], 9)
    assert_same_outputs(feed(fresh, k[:, 50:], v[:, 50:], 4), feed(cold, k[:, 50:], v[:, 50:], 4))


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("mode", QUANTIZED)
def test_truncated_restore_of_a_quantized_snapshot_equals_a_cold_prefill(kind, mode):
    k, v = kv(2, 60, 32, seed=6)
    live = make_cache(kind, mode)
    feed(live, k[:, :40], v[:, :40], 40)
    snap = live.snapshot()
    t = 36
    assert snap.can_restore_to(t)
    restored = make_cache(kind, mode)
    restored.restore(snap, t)
    cold = make_cache(kind, mode)
    feed(cold, k[:, :t], v[:, :t], t)
    assert_same_outputs(feed(restored, k[:, t:], v[:, t:], 3), feed(cold, k[:, t:], v[:, t:], 3))


@pytest.mark.parametrize("snap_mode, live_mode", [("int8", "int4"), ("int4", "int8"), ("int8", NATIVE),
                                                  (NATIVE, "int4"), ("bf16", "fp16")])
def test_restore_into_another_mode_is_refused_and_leaves_the_cache_alone(snap_mode, live_mode):
    k, v = kv(2, 40, 32, seed=7)
    src = make_cache("full", snap_mode)
    feed(src, k, v, 40)
    snap = src.snapshot()
    live = make_cache("full", live_mode)
    feed(live, v[:, :25], k[:, :25], 5)
    before = (live.offset, live.floor, stored_bytes(live.export(live.floor, live.offset)))
    with pytest.raises(SnapshotMismatch) as err:
        live.restore(snap)
    assert err.value.reason == KV_MODE_MISMATCH
    assert (live.offset, live.floor, stored_bytes(live.export(live.floor, live.offset))) == before


# --- the per-layer table -------------------------------------------------------------------------------

def test_layer_modes_keeps_boundary_attention_layers_native():
    attn = [True, False, True, True, True, False, True]
    assert layer_modes(attn, "int8") == ["int8", NATIVE, "int8", "int8", "int8", NATIVE, "int8"]
    assert layer_modes(attn, "int4", 1) == [NATIVE, NATIVE, "int4", "int4", "int4", NATIVE, NATIVE]
    assert layer_modes(attn, "int4", 2) == [NATIVE] * 3 + ["int4"] + [NATIVE] * 3
    assert layer_modes(attn, "int8", 3) == [NATIVE] * 7 == layer_modes(attn, "int8", 9)
    assert layer_modes(attn) == [NATIVE] * 7
    with pytest.raises(ValueError):
        layer_modes(attn, "int2")
    with pytest.raises(ValueError):
        layer_modes(attn, "int8", -1)


def test_describe_modes():
    specs = [full(2, 32)] * 28 + [recurrent(state=(4,)), recurrent(state=(4,))]
    table = layer_modes([s.is_attention for s in specs], "int8", 1)
    assert describe_modes(table, specs) == "int8 on 26 of 28 attention layers"
    assert describe_modes(["int8"] * 26 + [NATIVE] * 4) == "int8 on 26 of 30 attention layers"
    assert describe_modes([NATIVE] * 30) == "native on all 30 attention layers"
    assert describe_modes(["int4", "int8", "int8", NATIVE]) == "int8 on 2, int4 on 1 of 4 attention layers"
    assert describe_modes([NATIVE], [recurrent(state=(4,))]) == "native (no attention layers)"
    with pytest.raises(ValueError):
        describe_modes([NATIVE], specs)
    assert effective_mode(table) == "int8"
    assert effective_mode([NATIVE] * 3) == NATIVE
    assert effective_mode(["int8", "int4"]) == "mixed"


# --- real models ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from turnkv.models.llama import LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    hf = LlamaForCausalLM(cfg).eval()
    return LlamaModel.from_checkpoint(cfg.to_dict(), hf.state_dict(), torch.float32)


def run_chunks(model, caches, tokens, chunk):
    return torch.cat([model.step(tokens[a:a + chunk], caches, "all") for a in range(0, tokens.shape[0], chunk)])


@torch.inference_mode()
def test_tiny_llama_logits_per_mode(tiny_llama):
    model, specs = tiny_llama, tiny_llama.cache_specs()
    tokens = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(0))
    logits = {mode: run_chunks(model, make_caches(specs, modes=[mode] * len(specs)), tokens, 32) for mode in MODES}
    native = logits[NATIVE]
    spread = native.abs().max()
    for mode in ("bf16", "fp16", "int8"):
        assert (logits[mode] - native).abs().max() < 0.02 * spread, mode
    assert not torch.equal(logits["int8"], native)
    diff4 = (logits["int4"] - native).abs().max()
    assert 0 < diff4 < 0.25 * spread
    # same argmax on almost every position even at 4 bits
    assert (logits["int4"].argmax(-1) == native.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("mode", QUANTIZED)
@torch.inference_mode()
def test_tiny_llama_reused_quantized_prefix_equals_the_cold_run(tiny_llama, mode):
    """A restored quantized prefix is the cold run's bytes, so the continuation is bit-identical."""
    model, specs = tiny_llama, tiny_llama.cache_specs()
    modes = [mode] * len(specs)
    tokens = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(1))
    cold = make_caches(specs, modes=modes)
    model.step(tokens[:50], cold, "none")
    want = run_chunks(model, cold, tokens[50:], 7)
    warm = make_caches(specs, modes=modes)
    model.step(tokens[:30], warm, "none")
    model.step(tokens[30:50], warm, "none")
    snaps = [c.snapshot() for c in warm]
    reused = make_caches(specs, modes=modes)
    for c, s in zip(reused, snaps):
        c.restore(s)
    assert torch.equal(run_chunks(model, reused, tokens[50:], 7), want)
    mismatched = make_caches(specs, modes=["int8" if mode == "int4" else "int4"] * len(specs))
    with pytest.raises(SnapshotMismatch) as err:
        mismatched[0].restore(snaps[0])
    assert err.value.reason == KV_MODE_MISMATCH


@torch.inference_mode()
def test_tiny_gemma3_sliding_layers_in_quantized_modes():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from turnkv.models.gemma3 import Gemma3Model

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=1024)
    model = Gemma3Model.from_checkpoint(cfg.to_dict(), Gemma3ForCausalLM(cfg).eval().state_dict(), torch.float32)
    specs = model.cache_specs()
    assert [s.kind for s in specs] == ["sliding", "full", "sliding"]
    tokens = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(2))
    native = run_chunks(model, make_caches(specs, slack=4), tokens, 16)
    spread = native.abs().max()
    for mode, tol in (("int8", 0.02), ("int4", 0.25)):
        caches = make_caches(specs, modes=[mode] * 3, slack=4)
        got = run_chunks(model, caches, tokens, 16)
        assert 0 < (got - native).abs().max() < tol * spread
        assert isinstance(caches[0].store, KVStore) and caches[0].store.mode == mode
