"""Kimi Linear against transformers' KimiLinearForCausalLM on a tiny random config: Kimi Delta
Attention (per-channel gated delta rule after a short conv, gated RMSNorm output) on the linear
layers, MLA (NoPE, latent KV cache) on the full layers, a dense first layer and the sigmoid-routed
MoE with shared experts after it; the latent K/V cache and the recurrent state's restore rule.
(The 8-turn chat with reuse == cold, edits, regenerate and three conversations at once:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)"""

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from ssm_family_checks import (PARITY_TOL, REUSE_TOL, check_parity, check_reuse, fresh, greedy, hf_greedy,
                               perturb_vectors, run_chunks, save_and_load)
from tiny import prompt
from turnkv.cache.base import DIVERGED_UNTRIMMABLE, SnapshotMismatch
from turnkv.cache.specs import FULL, RECURRENT
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.kimi_linear import KimiLinearModel, kda_chunked, kda_step
from window_family_checks import KV_MODES, WEIGHT_SPECS, check_kv_mode_reuse, check_long_prompt, check_weight_format

VOCAB = 256
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, layer_types=TYPES,
              max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def build(**overrides):
    """The tiny Kimi Linear with every vector nudged and the routers' score-correction biases set
    (shared with tests/test_family_reuse.py and tests/test_batching.py)."""
    hf = KimiLinearForCausalLM(config(**overrides)).eval()
    perturb_vectors(hf)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=g))
    return hf


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    hf = build(**overrides)
    return save_and_load(hf, tmp_path), hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("kimi_linear"))


def test_registered():
    assert ARCHITECTURES["kimi_linear"] == "kimi_linear:KimiLinearModel"
    assert family_class("kimi_linear") is KimiLinearModel


def test_cache_specs(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [RECURRENT, FULL, RECURRENT, FULL]
    # conv over q|k|v (3 * 4 heads * 16), recurrent [heads, k dim, v dim]
    assert dict(specs[0].fields) == {"conv": (3, 192), "recurrent": (4, 16, 16)}
    # MLA: the latent [kv_lora_rank 24 | rope 8] as one head, split in halves as K and V
    assert (specs[1].heads, specs[1].head_dim) == (1, 16)


def test_kda_chunked_equals_token_by_token():
    # the chunked form (a chunk of 64 crossed) against the sequential recurrence, strong decays included
    g = torch.Generator().manual_seed(0)
    H, T, D = 2, 70, 8
    q, k = (torch.nn.functional.normalize(torch.randn(H, T, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(H, T, 5, generator=g)
    decay = -torch.rand(H, T, D, generator=g) * 6
    beta = torch.rand(H, T, generator=g)
    s0 = torch.randn(H, D, 5, generator=g)
    out, state = kda_chunked(q, k, v, decay, beta, s0)
    st, steps = s0, []
    for t in range(T):
        o, st = kda_step(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], st)
        steps.append(o)
    assert (out - torch.stack(steps, 1)).abs().max().item() < 1e-5
    assert (state - st).abs().max().item() < 1e-5


def test_last_logits_300_token_prompt(pair):
    model, hf = pair
    print("kimi_linear last-position diff", check_long_prompt(model, hf, prompt(300)))


def test_parity_chunks_and_decode(pair):
    # 100 tokens: the 64-token KDA chunk is crossed inside the one-shot prefill
    model, hf = pair
    print("kimi_linear parity", check_parity(model, hf, prompt(100, seed=5), chunk=7, decode=12))


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(30, seed=7)
    ours = greedy(model, p, 32)
    assert ours == hf_greedy(hf, p, 32)
    assert len(set(ours)) > 3, "degenerate tiny model: greedy text is one repeated token"


def test_reuse_is_exact_and_recurrent_refuses_other_lengths(pair):
    model, _ = pair
    check_reuse(model, prompt(60, seed=11), L=37)


def test_restore_boundary_one_token_inside_and_outside(pair):
    """The KDA state's rule is ``t == length``: a snapshot after 50 tokens restores to 50 (== a cold
    prefill of 50, continued), and 49 or 51 are refused as diverged_untrimmable / out of range;
    the MLA latent cache alone could go back to 49."""
    model, _ = pair
    tokens = prompt(60, seed=13)
    caches = fresh(model)
    run_chunks(model, caches, tokens[:50], 16)
    snaps = [c.snapshot() for c in caches]
    warm = fresh(model)
    for c, s in zip(warm, snaps):
        c.restore(s, 50)
    cold = fresh(model)
    run_chunks(model, cold, tokens[:50], 50)
    a, b = run_chunks(model, warm, tokens[50:], 3), run_chunks(model, cold, tokens[50:], 3)
    assert (a - b).abs().max().item() <= REUSE_TOL
    assert snaps[1].can_restore_to(49) and not snaps[0].can_restore_to(49)
    probe = fresh(model)
    with pytest.raises(SnapshotMismatch) as err:
        probe[0].restore(snaps[0], 49)
    assert err.value.reason == DIVERGED_UNTRIMMABLE
    with pytest.raises(SnapshotMismatch):
        probe[0].restore(snaps[0], 51)
    assert all(c.offset == 0 for c in probe)


def test_variant_q_lora_grouped_router_bias(tmp_path):
    # the q LoRA path, grouped top-k routing (2 groups, 1 kept), biases on the MLA projections,
    # an odd latent width (padded to split in halves), v head wider than q/k
    model, hf = tiny(tmp_path, seed=1, q_lora_rank=20, num_local_experts=8, n_group=2, topk_group=1,
                     attention_bias=True, kv_lora_rank=23, v_head_dim=32)
    assert model.cache_specs()[1].head_dim == 16
    d = check_parity(model, hf, prompt(70, seed=9), chunk=11, decode=5)
    assert max(d.values()) < PARITY_TOL


@pytest.mark.parametrize("mode", KV_MODES)
def test_reuse_exact_in_every_kv_mode(pair, mode):
    # the MLA layers' latent cache in each storage mode (the KDA state stays float32)
    check_kv_mode_reuse(pair[0], mode)


@pytest.fixture(scope="module")
def calm_pair(tmp_path_factory):
    # init 0.02: transformers' own bfloat16 run of it stays within 0.8% of float32 (at init 0.1, 16%)
    return tiny(tmp_path_factory.mktemp("kimi_linear_calm"), initializer_range=0.02)


@pytest.mark.parametrize("spec", WEIGHT_SPECS)
def test_weight_formats_and_bfloat16(calm_pair, spec):
    print(spec, check_weight_format(*calm_pair, spec))


def test_kda_state_is_float32_under_bfloat16(calm_pair):
    # transformers keeps the KDA state in float32 whatever the model dtype; so does the cache here
    from turnkv.cache.specs import make_caches
    from turnkv.models.weights import load_model

    _, hf = calm_pair
    model = load_model(KimiLinearModel, hf.config.to_dict(), hf.state_dict(), torch.bfloat16, "native")
    caches = make_caches(model.cache_specs(), torch.bfloat16)
    assert caches[0].state["recurrent"].dtype == torch.float32 and caches[1].dtype == torch.bfloat16
    with torch.no_grad():
        out = model.step(prompt(20), caches, "last")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
