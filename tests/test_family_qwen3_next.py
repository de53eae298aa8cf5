"""Qwen3-Next (gated delta-net + gated full attention + shared-expert MoE) against transformers'
Qwen3NextForCausalLM on a tiny random config.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

from functools import partial

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from ssm_family_checks import check_parity, fresh, perturb_vectors, run_chunks, save_and_load
from tiny import prompt as random_tokens
from turnkv.cache.specs import FULL, RECURRENT

VOCAB = 256
prompt = partial(random_tokens, low=0)


def tiny(tmp_path):
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=512, initializer_range=0.05, attn_implementation="eager")
    hf = Qwen3NextForCausalLM(config).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path)
    return model, hf


def test_cache_specs(pair):
    model, _ = pair
    kinds = [s.kind for s in model.cache_specs()]
    assert kinds == [RECURRENT, RECURRENT, RECURRENT, FULL]
    s = model.cache_specs()[0]
    # conv over q|k|v (2 * 2 * 16 + 4 * 8 channels), recurrent state [value heads, k dim, v dim]
    assert dict(s.fields) == {"conv": (3, 96), "recurrent": (4, 16, 8)}
    full = model.cache_specs()[3]
    assert (full.heads, full.head_dim) == (2, 16)


def test_parity_odd_chunks(pair):
    model, hf = pair
    check_parity(model, hf, prompt(90, seed=5), chunk=65, decode=2)


def test_attention_layer_snapshot_still_trims(pair):
    # hybrid: the full-attention layer can be truncated, the delta-net layers cannot
    model, _ = pair
    caches = fresh(model)
    run_chunks(model, caches, prompt(20), 20)
    snaps = [c.snapshot() for c in caches]
    assert snaps[3].can_restore_to(10)
    assert not any(snaps[i].can_restore_to(10) for i in range(3))


def test_token_by_token_from_the_first_token(pair):
    # every token through the single-step paths, starting from empty state
    model, hf = pair
    check_parity(model, hf, prompt(12, seed=13), chunk=1, decode=11)
