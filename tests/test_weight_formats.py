"""Weight formats (turnkv/models/weights.py) and the process settings (turnkv/launch.py), on tiny
random Llama / Gemma 3 models: every format runs prefill (dense path), chunked prefill and decode
(packed int8/int4 kernels) with every cache kind those families use, and stays within its
tolerance of the float32 reference; packing keeps the Model interface."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_gemma3, tiny_llama
from turnkv.cache.specs import make_caches
from turnkv.models.base import Model, embedding, linear
from turnkv.models.packed import Int4Weight, Int8Weight, PackedWeight, dequantize_int4, quantize_int4
from turnkv.models.weights import FORMATS, apply_format, load_model

BUILDERS = {"llama": tiny_llama, "gemma3": lambda: tiny_gemma3(window=16)}


def run(model, ids: torch.Tensor, chunk: int, dtype=torch.float32) -> torch.Tensor:
    caches = make_caches(model.cache_specs(), dtype)
    with torch.inference_mode():
        return torch.cat([model.step(ids[a:a + chunk], caches, "all").float() for a in range(0, len(ids), chunk)])


def build(model, hf, dtype, weights, tensors=None):
    return load_model(type(model), hf.config.to_dict(), tensors or hf.state_dict(), dtype, weights)


def on_q4_grid(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Projection weights snapped to a GGUF Q4_1-style grid (groups of 32, 16 levels), as the
    bundled SmolLM2 GGUF's are: the int4 format then holds them exactly."""
    out = {}
    for name, t in tensors.items():
        if t.ndim == 2 and "proj" in name and t.shape[1] % 32 == 0:
            t = dequantize_int4(*quantize_int4(t))
        out[name] = t
    return out


# max |logit - float32 logit| / max |float32 logit| on the tiny models (int8 requantizes the
# Q4-grid weights per row; int4 holds them exactly, its error is bfloat16 rounding)
TOLERANCE = {"native": 0.03, "bf16": 0.03, "int8": 0.08, "int4x2": 0.05, "int4": 0.05, "auto": 0.05}


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("spec", ["bfloat16:native", "float32:bf16", "bfloat16:int8", "float32:int8",
                                  "float32:int4x2", "bfloat16:int4", "float32:auto"])
def test_format_close_to_float32_on_prefill_chunks_and_decode(family, spec):
    tiny_model, hf = BUILDERS[family]()
    tensors = on_q4_grid(hf.state_dict())
    ref_model = build(tiny_model, hf, torch.float32, "native", tensors)
    dtype_name, weights = spec.split(":")
    dtype = getattr(torch, dtype_name)
    model = build(tiny_model, hf, dtype, weights, tensors)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    ref = run(ref_model, ids, 40)
    scale = ref.abs().max().item()
    one = run(model, ids, 40, dtype)       # many rows: dense bf16 path
    dec = run(model, ids, 1, dtype)        # one row: int8/int4 kernels
    mixed = run(model, ids, 7, dtype)      # chunks of 7: int4 kernel, int8 dense path
    for got in (one, dec, mixed):
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOLERANCE[weights] * scale
    # the two paths multiply the same weights: they agree to bfloat16 rounding
    assert (one - dec).abs().max().item() < 0.05 * scale
    # the Model interface is intact: "last" is the last row of "all", "none" returns None
    caches = make_caches(model.cache_specs(), dtype)
    with torch.inference_mode():
        assert model.step(ids[:5], caches, "none") is None
        last = model.step(ids[5:9], caches, "last").float()
    assert torch.allclose(last, run(model, ids[:9], 9, dtype)[-1], atol=0.05 * scale)


def test_native_float32_is_untouched():
    model, hf = tiny_llama()
    same = build(model, hf, torch.float32, "native")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(run(model, ids, 20), run(same, ids, 20))
    assert not any(isinstance(m, PackedWeight) for m in same.modules())


def test_packing_replaces_declared_weights_only():
    model, hf = tiny_gemma3()
    packed = apply_format(model, "int8")
    assert isinstance(packed.layers[0].attn.wqkv, Int8Weight)
    assert isinstance(packed.layers[0].mlp.wdown, Int8Weight)
    assert packed.layers[0].mlp.wdown.dense is not None
    # the lm_head is only multiplied by one row in prefill: no dense copy; the (tied) embedding
    # stays a native table
    from turnkv.models.weights import RescoredHead

    assert isinstance(packed.lm_head, RescoredHead)
    assert isinstance(packed.lm_head.inner, Int8Weight) and packed.lm_head.inner.dense is None
    assert isinstance(packed.embed, torch.nn.Parameter)
    assert isinstance(packed.layers[0].ln_in, torch.nn.Parameter)
    bf16 = apply_format(tiny_gemma3()[0], "bf16")
    assert bf16.lm_head.inner is bf16.embed   # tied and in the same packing: packed once
    int4 = apply_format(tiny_llama()[0], "int4")
    assert isinstance(int4.layers[0].mlp.wgu, Int4Weight) and int4.layers[0].mlp.wgu.passes == 1
    # the int4 head only nominates candidates for the float32 rescoring: single-pass
    assert isinstance(int4.lm_head.inner, Int4Weight) and int4.lm_head.inner.passes == 1
    # int4x2 keeps its ~8-bit precision in the head's tail too
    int4x2 = apply_format(tiny_llama()[0], "int4x2")
    assert isinstance(int4x2.lm_head.inner, Int4Weight) and int4x2.lm_head.inner.passes == 2


def test_auto_uses_int4_only_where_lossless():
    model, hf = tiny_llama()
    snapped = build(model, hf, torch.float32, "auto", on_q4_grid(hf.state_dict()))
    assert isinstance(snapped.layers[0].mlp.wgu, Int4Weight) and snapped.layers[0].mlp.wgu.passes == 1
    raw = build(model, hf, torch.float32, "auto")      # random normal weights: int4 would lose
    assert isinstance(raw.layers[0].mlp.wgu, Int4Weight) and raw.layers[0].mlp.wgu.passes == 2


def test_family_without_declared_weights_supports_only_native():
    class Bare(Model):
        family = "bare"

        def cache_specs(self):
            return []

        def forward(self, batch):
            return None

        @classmethod
        def from_checkpoint(cls, config, tensors, dtype):
            return cls()

    assert apply_format(Bare(), "native") is not None
    with pytest.raises(ValueError, match="native"):
        apply_format(Bare(), "int8")
    with pytest.raises(ValueError, match="unknown weight format"):
        apply_format(Bare(), "int3")
    assert set(FORMATS) >= {"native", "bf16", "int8", "int4", "auto"}


def test_int8_kernel_and_lookup_match_dequantized_weight():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    p = Int8Weight(w)
    deq = p.q.float() * p.scale[:, None]
    assert (deq - w).abs().max().item() <= p.scale.max().item() / 2 + 1e-6
    for rows in (3, 20):        # the int8 kernel, then the dense bf16 path
        x = torch.randn(rows, 64)
        ref = x @ deq.t()
        assert (linear(x, p) - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    head = Int8Weight(w, dense=False)   # many rows without a dense copy: blockwise dequantization
    x = torch.randn(20, 64)
    assert (linear(x, head) - x @ deq.t()).abs().max().item() < 0.05 * (x @ deq.t()).abs().max().item()
    tok = torch.tensor([5, 0, 95])
    assert torch.allclose(embedding(tok, p, torch.float32), deq[tok])


def test_int4x2_is_a_finer_grouped_quantizer():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.linspace(0.01, 1, 128)   # very different column ranges
    p1, p2, p8 = Int4Weight(w), Int4Weight(w, passes=2), Int8Weight(w)
    err = {name: (p.dense.float() - w).norm().item() for name, p in (("int4", p1), ("int4x2", p2), ("int8", p8))}
    assert err["int4x2"] < err["int8"] < err["int4"]
    for rows in (1, 40):        # the kernel on [x, x], then the dense path
        x = torch.randn(rows, 128)
        ref = x @ p2.dense.float().t()
        assert (linear(x, p2) - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_int4_recovers_gguf_q4_1_blocks_exactly():
    """A Q4_1 block (w = d * q + m, codes spanning 0..15) is requantized to the same codes."""
    torch.manual_seed(0)
    N, K = 32, 128
    d = torch.rand(N, K // 32, 1) * 0.01 + 1e-3
    m = -torch.rand(N, K // 32, 1) * 0.05
    q = torch.randint(0, 16, (N, K // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).reshape(N, K)
    codes, scale, lo = quantize_int4(w)
    assert torch.equal(codes.reshape(q.shape), q.to(torch.int32))
    for rows in (2, 40):        # the int4 kernel, then the dense bf16 path
        x = torch.randn(rows, K)
        ref = x @ w.t()
        assert (linear(x, Int4Weight(w)) - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_launch_settings():
    from turnkv import launch

    env = launch.recommended_env(threads=3)
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == launch.RECOMMENDED_MALLOC.mmap_threshold
    assert {"MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"} <= set(env)
    before = torch.get_num_threads()
    try:
        settings = launch.configure_process(threads=1)
        assert settings.threads == 1 and torch.get_num_threads() == 1
        assert settings.malloc_applied in (True, False)
    finally:
        torch.set_num_threads(before)


# How far apart two roundings of one bfloat16 computation may land: packed formats multiply in
# bfloat16, and a row's rounding depends on the path it takes (prefill chunk: dense GEMM; decode or
# a short suffix: the packed kernel), so a cold run and a reused run agree to ~2^-8 relative, not to
# float32 noise as native float32 does.
BF16_PATH_TOL = 0.02


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4x2", "auto"])
def test_reuse_matches_the_cold_run_in_a_packed_format(family, weights):
    """An 8-turn chat with the prompt cache against the cold run, in a packed format. Both play the
    same history (the cold run's replies), so every turn is compared. Greedy tokens must be equal,
    except at a step where the cold run itself is a near-tie at bfloat16 precision (top-2 gap below
    BF16_PATH_TOL of the logit scale) and the reused run picked the runner-up; first-token logits
    stay within that tolerance. (Native float32 is held to identical tokens: test_engine_reuse.)"""
    import random

    from tests.tiny import engine, request

    tiny_model, hf = BUILDERS[family]()
    model = build(tiny_model, hf, torch.float32, weights, on_q4_grid(hf.state_dict()))
    rng = random.Random(3)
    system = [rng.randrange(3, 256) for _ in range(40)]
    users = [[rng.randrange(3, 256) for _ in range(rng.choice((3, 12, 25)))] for _ in range(8)]
    on, off = engine(model, chunk=8), engine(model, budget=0, chunk=8)
    history, exact, prev_prompt = [system], 0, 0
    for turn, user in enumerate(users):
        history.append(user)
        a, b = on.generate(request(history, 5)), off.generate(request(history, 5))
        scale = b.first_logits.abs().max().item()
        assert (a.first_logits - b.first_logits).abs().max().item() < BF16_PATH_TOL * scale, turn
        if turn:   # everything the previous turn stored (its prompt and reply) was reused
            assert a.usage.cached_tokens >= prev_prompt, (turn, a.usage)
        prev_prompt = b.usage.prompt_tokens
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is None:
            exact += 1
        else:   # the cold run's logits at the diverging step: a near-tie, and a took the runner-up
            seq = torch.tensor([t for m in history for t in m] + b.token_ids[:k])
            logits = run(model, seq, 8)[-1]
            top2 = logits.topk(2)
            assert top2.values[0] - top2.values[1] < BF16_PATH_TOL * scale, (turn, k, top2)
            assert a.token_ids[k] in top2.indices.tolist(), (turn, k)
        history.append(b.token_ids[:-1])
    assert exact >= 6, exact


def test_dense_path_agrees_with_the_kernels():
    """Many rows (dense bfloat16 GEMM on the kernel's weights) and one row at a time (the packed
    kernel) agree to bfloat16 rounding."""
    torch.manual_seed(0)
    w = torch.randn(512, 256) * 0.05
    x = torch.randn(24, 256)
    for p in (Int8Weight(w), Int4Weight(w), Int4Weight(w, passes=2)):
        many = linear(x, p)
        ones = torch.cat([linear(x[i:i + 1], p) for i in range(len(x))])
        assert (many - ones).abs().max().item() <= 2 ** -6 * ones.abs().max().item(), type(p).__name__


def test_rescored_head_gives_float32_top_logits():
    """A packed lm_head's kernel output is bfloat16 (logits in steps of 2^-8); the top candidates
    are recomputed in float32 from the unquantized table, so greedy picks are not decided by ties."""
    from turnkv.models.weights import RescoredHead

    model, hf = tiny_llama()
    packed = build(model, hf, torch.float32, "int4x2")
    assert isinstance(packed.lm_head, RescoredHead)
    packed.lm_head.top = 64          # the tiny vocabulary (256) would otherwise have no tail
    x = torch.randn(3, 64)
    exact = x @ hf.lm_head.weight.detach().t()
    got = linear(x, packed.lm_head)
    top = exact.topk(16, dim=-1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), atol=1e-5)
    assert not torch.allclose(got, exact, atol=1e-5)        # the tail keeps the packed values
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    many = linear(torch.randn(40, 64), packed.lm_head)       # many rows: the float32 table
    assert many.dtype == torch.float32 and many.shape == (40, 256)
    # a bfloat16 compute dtype still gets float32 logits: rounding them back would bring the ties back
    model16, hf16 = tiny_llama()
    head16 = build(model16, hf16, torch.bfloat16, "int4x2").lm_head
    x16 = x.to(torch.bfloat16)
    got16 = linear(x16, head16)
    exact16 = x16.float() @ hf16.lm_head.weight.detach().t()
    top16 = exact16.topk(16, dim=-1).indices
    assert got16.dtype == torch.float32
    assert torch.allclose(got16.gather(1, top16), exact16.gather(1, top16), atol=1e-5)
