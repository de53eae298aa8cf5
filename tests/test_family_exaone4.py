"""EXAONE 4 against transformers' Exaone4ForCausalLM on a tiny random config: sliding RoPE layers,
global NoPE layers, QK-norm, post-norm branches. (The 8-turn chat with reuse == cold, edits,
regenerate and three conversations at once: tests/test_family_reuse.py; batched == alone:
tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import Exaone4Config, Exaone4ForCausalLM

from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, SLIDING

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


def test_cache_specs_sliding_local_full_global(pair):
    model, hf = pair
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention"]
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [SLIDING, SLIDING, FULL, SLIDING]
    assert specs[0].window == WINDOW and (specs[0].heads, specs[0].head_dim) == (2, 16)
    # the global layer is NoPE, the local ones rotate
    assert [layer.attn.rotate for layer in model.layers] == [True, True, False, True]


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


