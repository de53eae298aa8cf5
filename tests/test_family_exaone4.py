"""EXAONE 4 against transformers' Exaone4ForCausalLM on a tiny random config: sliding RoPE layers,
global NoPE layers, QK-norm, post-norm branches. (The 8-turn chat with reuse == cold, edits,
regenerate and three conversations at once: tests/test_family_reuse.py; batched == alone:
tests/test_batching.py.)"""

import pytest
import torch
from transformers import Exaone4Config, Exaone4ForCausalLM

from ssm_family_checks import check_parity, greedy, hf_greedy, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, SLIDING
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.exaone4 import Exaone4Model
from window_family_checks import (KV_MODES, WEIGHT_SPECS, check_kv_mode_reuse, check_long_prompt,
                                  check_weight_format, check_window_boundary)

VOCAB = 256
WINDOW = 16


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
              sliding_window_pattern=3, max_position_embeddings=4096, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    hf = Exaone4ForCausalLM(Exaone4Config(**kw)).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("exaone4"))


def test_registered():
    assert ARCHITECTURES["exaone4"] == "exaone4:Exaone4Model"
    assert family_class("exaone4") is Exaone4Model


def test_cache_specs_sliding_local_full_global(pair):
    model, hf = pair
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention"]
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [SLIDING, SLIDING, FULL, SLIDING]
    assert specs[0].window == WINDOW and (specs[0].heads, specs[0].head_dim) == (2, 16)
    # the global layer is NoPE, the local ones rotate
    assert [layer.attn.rotate for layer in model.layers] == [True, True, False, True]


def test_last_logits_300_token_prompt(pair):
    model, hf = pair
    print("exaone4 last-position diff", check_long_prompt(model, hf, prompt(300)))


def test_parity_chunks_and_decode_across_the_window(pair):
    model, hf = pair
    print("exaone4 parity", check_parity(model, hf, prompt(90, seed=5), chunk=7, decode=20))


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(40, seed=7)
    ours = greedy(model, p, 32)   # 72 tokens: the window slides while decoding
    assert ours == hf_greedy(hf, p, 32)
    assert len(set(ours)) > 3, "degenerate tiny model: greedy text is one repeated token"


def test_window_truncation_one_token_inside_and_outside(pair):
    model, _ = pair
    assert check_window_boundary(model, prompt(220, seed=11), 200, WINDOW) == 128 + WINDOW - 1


def test_variant_no_window_all_global_with_rope_llama3_scaling_tied(tmp_path):
    # sliding_window None: every layer is global and rotated (transformers: ``sliding_window is None
    # or is_sliding``); llama3 RoPE scaling as the released checkpoints use; tied embeddings
    rope = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    # (transformers' config divides by the pattern it zeroes without a window: pass layer_types)
    model, hf = tiny(tmp_path, seed=1, sliding_window=None, layer_types=["full_attention"] * 4,
                     rope_parameters=rope, tie_word_embeddings=True)
    assert [s.kind for s in model.cache_specs()] == [FULL] * 4
    assert all(layer.attn.rotate for layer in model.layers)
    assert model.lm_head is model.embed
    check_parity(model, hf, prompt(120, seed=9), chunk=13, decode=6)


@pytest.mark.parametrize("mode", KV_MODES)
def test_reuse_exact_in_every_kv_mode(pair, mode):
    check_kv_mode_reuse(pair[0], mode)


@pytest.mark.parametrize("spec", WEIGHT_SPECS)
def test_weight_formats_and_bfloat16(pair, spec):
    print(spec, check_weight_format(*pair, spec))
