"""Kimi Linear against transformers' KimiLinearForCausalLM on a tiny random config: Kimi Delta
Attention (per-channel gated delta rule after a short conv, gated RMSNorm output) on the linear
layers, MLA (NoPE, latent KV cache) on the full layers, a dense first layer and the sigmoid-routed
MoE with shared experts after it; the latent K/V cache and the recurrent state's restore rule.
(The 8-turn chat with reuse == cold, edits, regenerate and three conversations at once:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from ssm_family_checks import (PARITY_TOL, check_parity, check_restore_at_its_length, nudge_score_biases,
                               perturb_vectors, saved_pair)
from tiny import prompt
from turnkv.cache.specs import FULL, RECURRENT
from turnkv.models.kimi_linear import KimiLinearModel, kda_chunked, kda_step

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
    nudge_score_biases(hf)
    return hf


def tiny(tmp_path, seed=0, **overrides):
    return saved_pair(tmp_path, seed, lambda: build(**overrides))


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


def test_restore_boundary_one_token_inside_and_outside(pair):
    """The KDA state's rule is ``t == length``: a snapshot after 50 tokens restores to 50 (== a cold
    prefill of 50, continued), and 49 or 51 are refused as diverged_untrimmable / out of range;
    the MLA latent cache alone could go back to 49."""
    check_restore_at_its_length(pair[0], prompt(60, seed=13), 50)


def test_variant_q_lora_grouped_router_bias(tmp_path):
    # the q LoRA path, grouped top-k routing (2 groups, 1 kept), biases on the MLA projections,
    # an odd latent width (padded to split in halves), v head wider than q/k
    model, hf = tiny(tmp_path, seed=1, q_lora_rank=20, num_local_experts=8, n_group=2, topk_group=1,
                     attention_bias=True, kv_lora_rank=23, v_head_dim=32)
    assert model.cache_specs()[1].head_dim == 16
    d = check_parity(model, hf, prompt(70, seed=9), chunk=11, decode=5)
    assert max(d.values()) < PARITY_TOL


def calm(tmp_path):
    # init 0.02: transformers' own bfloat16 run of it stays within 0.8% of float32 (at init 0.1, 16%)
    return tiny(tmp_path, initializer_range=0.02)


@pytest.fixture(scope="module")
def calm_pair(tiny_pair):
    return tiny_pair(calm)


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
