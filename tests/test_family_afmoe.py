"""AFMoE against transformers' AfmoeForCausalLM on a tiny random config: sliding-window RoPE layers
and NoPE global layers, QK-norm and a sigmoid output gate on every attention, pre/post norms around
both branches, muP embedding scale, a dense first layer and a sigmoid token-choice MoE with expert
bias, route scale and shared experts. (8-turn chat reuse == cold, edits, regenerate:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)"""

import pytest
import torch
from transformers import AfmoeConfig, AfmoeForCausalLM

from ssm_family_checks import check_parity, greedy, hf_greedy, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, SLIDING
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.afmoe import AfmoeModel
from window_family_checks import (KV_MODES, WEIGHT_SPECS, check_kv_mode_reuse, check_long_prompt,
                                  check_weight_format, check_window_boundary)

VOCAB = 256
WINDOW = 16


def config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
              num_experts_per_tok=2, num_shared_experts=1, route_scale=2.0, global_attn_every_n_layers=2,
              sliding_window=WINDOW, mup_enabled=True, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    return AfmoeConfig(**kw)


def build_hf(seed=0, **overrides):
    torch.manual_seed(seed)
    hf = AfmoeForCausalLM(config(**overrides)).eval()
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():   # transformers zero-inits the router: give it (and the expert bias) values
        for layer in hf.model.layers[hf.config.num_dense_layers:]:
            layer.mlp.router.gate.weight.normal_(0.0, 0.3, generator=g)
    perturb_vectors(hf, scale=0.2)   # norms, expert_bias (and biases when configured)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = build_hf()
    return save_and_load(hf, tmp_path_factory.mktemp("afmoe")), hf


def test_registered():
    assert ARCHITECTURES["afmoe"] == "afmoe:AfmoeModel"
    assert family_class("afmoe") is AfmoeModel


def test_cache_specs(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [SLIDING, FULL, SLIDING, FULL]
    assert specs[0].window == WINDOW and (specs[0].heads, specs[0].head_dim) == (2, 16)
    assert [layer.attn.rotate for layer in model.layers] == [True, False, True, False]   # global layers: NoPE


def test_router_matches_transformers(pair):
    model, hf = pair
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(9))
    moe, ref = model.layers[1].mlp, hf.model.layers[1].mlp
    ours_w, ours_e = moe.route(x)
    _, ref_w, ref_e = ref.router(x[None], ref.expert_bias)
    assert torch.equal(ours_e, ref_e)
    assert torch.allclose(ours_w, ref_w, atol=1e-6)
    # the bias steers the choice: without it some tokens would take other experts
    plain = torch.sigmoid(x @ ref.router.gate.weight.t()).topk(2, dim=-1)[1]
    assert (plain.sort(-1).values != ours_e.sort(-1).values).any(dim=-1).sum() > 10


def test_last_logits_300_token_prompt(pair):
    model, hf = pair
    print("afmoe last-position diff", check_long_prompt(model, hf, prompt(300)))


def test_parity_chunks_and_decode_across_the_window(pair):
    model, hf = pair
    print("afmoe parity", check_parity(model, hf, prompt(90, seed=5), chunk=7, decode=20))


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(40, seed=7)
    ours = greedy(model, p, 32)
    assert ours == hf_greedy(hf, p, 32)
    assert len(set(ours)) > 3, "degenerate tiny model: greedy text is one repeated token"


def test_window_truncation_one_token_inside_and_outside(pair):
    model, _ = pair
    check_window_boundary(model, prompt(220, seed=11), 200, WINDOW)


def test_attention_bias_and_no_mup(tmp_path):
    hf = build_hf(seed=1, attention_bias=True, mup_enabled=False, num_dense_layers=2, num_shared_experts=2)
    model = save_and_load(hf, tmp_path)
    check_parity(model, hf, prompt(60, seed=2), chunk=9, decode=5)


@pytest.mark.parametrize("mode", KV_MODES)
def test_reuse_exact_in_every_kv_mode(pair, mode):
    check_kv_mode_reuse(pair[0], mode)


@pytest.fixture(scope="module")
def dense_routed(tmp_path_factory):
    # every token through all 8 experts, so a weight format's rounding cannot flip the expert choice
    # of this tiny random model (which says nothing about the format). Its logits are small (max ~3),
    # so bfloat16 rounding is a large share of their scale even in transformers: its own bfloat16
    # run of this model differs from its float32 run by 0.029 of the scale; turnkv measured 0.028
    # (bfloat16 compute), 0.016 (bf16 weights) and 0.032 (int8) against the 0.03 / 0.03 / 0.08
    # tolerances. Other seeds land on either side of 0.03 in transformers itself.
    hf = build_hf(seed=2, num_experts_per_tok=8)
    return save_and_load(hf, tmp_path_factory.mktemp("afmoe_dense")), hf


@pytest.mark.parametrize("spec", WEIGHT_SPECS)
def test_weight_formats_and_bfloat16(dense_routed, spec):
    # transformers' own bfloat16 run is 0.029 of the scale from float32 here, and bfloat16 GEMMs
    # round differently on CPUs without AVX-512 BF16: the margin is that of transformers itself
    print(spec, check_weight_format(*dense_routed, spec, tolerance={"native": 0.05, "bf16": 0.05}))
