"""Ministral 3 (``ministral3``: one sliding window on every layer, YaRN RoPE, Llama-4 query scaling by
absolute position) and Ministral (``ministral``: sliding and full layers by ``layer_types``) against
transformers on tiny random configs. (The 8-turn chat with reuse == cold, edits, regenerate and
three conversations at once: tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)"""

import pytest
import torch
from transformers import Ministral3Config, Ministral3ForCausalLM, MinistralConfig, MinistralForCausalLM

from ssm_family_checks import check_parity, greedy, hf_greedy, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, SLIDING
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.ministral import MinistralModel
from window_family_checks import (KV_MODES, WEIGHT_SPECS, check_kv_mode_reuse, check_long_prompt,
                                  check_weight_format, check_window_boundary)

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
def pair(tmp_path_factory):
    return tiny3(tmp_path_factory.mktemp("ministral3"))


@pytest.fixture(scope="module")
def pair1(tmp_path_factory):
    return tiny1(tmp_path_factory.mktemp("ministral"))


def test_registered():
    assert ARCHITECTURES["ministral3"] == ARCHITECTURES["ministral"] == "ministral:MinistralModel"
    assert family_class("ministral3") is family_class("ministral") is MinistralModel


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


def test_last_logits_300_token_prompt(pair):
    model, hf = pair
    print("ministral3 last-position diff", check_long_prompt(model, hf, prompt(300)))


def test_parity_chunks_and_decode_across_scale_steps(pair):
    # 150 tokens: the query scale steps at 64 and 128, in the middle of chunks and while decoding
    model, hf = pair
    print("ministral3 parity", check_parity(model, hf, prompt(150, seed=5), chunk=23, decode=25))


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(50, seed=7)
    ours = greedy(model, p, 32)   # crosses the window and the query-scale step at 64
    assert ours == hf_greedy(hf, p, 32)
    assert len(set(ours)) > 3, "degenerate tiny model: greedy text is one repeated token"


def test_window_truncation_one_token_inside_and_outside(pair):
    model, _ = pair
    check_window_boundary(model, prompt(220, seed=11), 200, WINDOW)


def test_ministral_layer_types_parity_and_greedy(pair1):
    model, hf = pair1
    check_long_prompt(model, hf, prompt(300, seed=2))
    check_parity(model, hf, prompt(70, seed=4), chunk=9, decode=12)
    p = prompt(40, seed=6)
    assert greedy(model, p, 32) == hf_greedy(hf, p, 32)


def test_ministral_window_truncation(pair1):
    model, _ = pair1
    check_window_boundary(model, prompt(220, seed=12), 200, WINDOW)


def test_ministral3_without_window_is_full_attention(tmp_path):
    # and YaRN with mscale != mscale_all_dim: an attention factor != 1 scales cos / sin
    rope = dict(ROPE3, mscale=2.0, mscale_all_dim=1.0, beta_fast=16.0)
    model, hf = tiny3(tmp_path, seed=1, sliding_window=None, tie_word_embeddings=True, rope_parameters=rope)
    assert [s.kind for s in model.cache_specs()] == [FULL] * 3
    assert model.rope.scaling == hf.model.rotary_emb.attention_scaling > 1.1
    check_parity(model, hf, prompt(100, seed=9), chunk=17, decode=5)


@pytest.mark.parametrize("mode", KV_MODES)
def test_reuse_exact_in_every_kv_mode(pair, mode):
    check_kv_mode_reuse(pair[0], mode)


@pytest.mark.parametrize("spec", WEIGHT_SPECS)
def test_weight_formats_and_bfloat16(pair, spec):
    print(spec, check_weight_format(*pair, spec))
