"""Ministral 3 (``ministral3``: one sliding window on every layer, YaRN RoPE, Llama-4 query scaling by
absolute position) and Ministral (``ministral``: sliding and full layers by ``layer_types``) against
transformers on tiny random configs. (The 8-turn chat with reuse == cold, edits, regenerate and
three conversations at once: tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import pytest
import torch
from transformers import Ministral3Config, Ministral3ForCausalLM, MinistralConfig, MinistralForCausalLM

from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, SLIDING

VOCAB = 256
WINDOW = 16
# YaRN over an original context of 64 positions, and the query scale steps up every 64 positions,
# so both matter within the prompts here
ROPE3 = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 64,
         "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def tiny3(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
              max_position_embeddings=1024, rope_parameters=dict(ROPE3), initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    hf = Ministral3ForCausalLM(Ministral3Config(**kw)).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


def tiny1(tmp_path, seed=0):
    torch.manual_seed(seed)
    hf = MinistralForCausalLM(MinistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair(tiny3)


@pytest.fixture(scope="module")
def pair1(tiny_pair):
    return tiny_pair(tiny1)


def test_cache_specs(pair, pair1):
    model, hf = pair
    assert [s.kind for s in model.cache_specs()] == [SLIDING] * 3
    assert model.cache_specs()[0].window == WINDOW
    assert model.q_scaling == (0.1, 64)
    # YaRN: the same frequencies and attention factor as transformers
    assert torch.equal(model.rope.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model.rope.scaling == hf.model.rotary_emb.attention_scaling
    assert [s.kind for s in pair1[0].cache_specs()] == [SLIDING, FULL, SLIDING, FULL]
    assert pair1[0].q_scaling is None


def test_ministral3_without_window_is_full_attention(tmp_path):
    # and YaRN with mscale != mscale_all_dim: an attention factor != 1 scales cos / sin
    rope = dict(ROPE3, mscale=2.0, mscale_all_dim=1.0, beta_fast=16.0)
    model, hf = tiny3(tmp_path, seed=1, sliding_window=None, tie_word_embeddings=True, rope_parameters=rope)
    assert [s.kind for s in model.cache_specs()] == [FULL] * 3
    assert model.rope.scaling == hf.model.rotary_emb.attention_scaling > 1.1
    check_parity(model, hf, prompt(100, seed=9), chunk=17, decode=5)


