"""Qwen3-Next (gated delta-net + gated full attention + shared-expert MoE) against transformers'
Qwen3NextForCausalLM on a tiny random config."""

from functools import partial

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from ssm_family_checks import (check_parity, check_reuse, fresh, greedy, hf_greedy, perturb_vectors, run_chunks,
                               save_and_load)
from tiny import prompt as random_tokens
from turnkv.cache.specs import FULL, RECURRENT
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.qwen3_next import Qwen3NextModel

VOCAB = 256
prompt = partial(random_tokens, low=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _build(tmp_path_factory)


def _build(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=512, initializer_range=0.05, attn_implementation="eager")
    hf = Qwen3NextForCausalLM(config).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path_factory.mktemp("qwen3_next"))
    return model, hf


def test_registered():
    assert ARCHITECTURES["qwen3_next"] == "qwen3_next:Qwen3NextModel"
    assert family_class("qwen3_next") is Qwen3NextModel


def test_cache_specs(pair):
    model, _ = pair
    kinds = [s.kind for s in model.cache_specs()]
    assert kinds == [RECURRENT, RECURRENT, RECURRENT, FULL]
    s = model.cache_specs()[0]
    # conv over q|k|v (2 * 2 * 16 + 4 * 8 channels), recurrent state [value heads, k dim, v dim]
    assert dict(s.fields) == {"conv": (3, 96), "recurrent": (4, 16, 8)}
    full = model.cache_specs()[3]
    assert (full.heads, full.head_dim) == (2, 16)


def test_parity_with_transformers(pair):
    # 100 tokens: the gated delta rule's 64-token chunk is crossed inside the one-shot prefill
    model, hf = pair
    diffs = check_parity(model, hf, prompt(100), chunk=7, decode=10)
    print("qwen3_next parity", diffs)


def test_parity_odd_chunks(pair):
    model, hf = pair
    check_parity(model, hf, prompt(90, seed=5), chunk=65, decode=2)


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(30, seed=7)
    assert greedy(model, p, 32) == hf_greedy(hf, p, 32)


def test_reuse_is_exact(pair):
    model, _ = pair
    check_reuse(model, prompt(60, seed=11), L=37)


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
