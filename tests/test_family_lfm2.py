"""LFM2 (short-conv + attention hybrid) against transformers' Lfm2ForCausalLM on a tiny random config.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import Lfm2Config, Lfm2ForCausalLM

from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, RECURRENT

VOCAB = 256


def tiny(tmp_path):
    torch.manual_seed(0)
    config = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=16,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
                        conv_L_cache=3, conv_bias=True, initializer_range=0.2,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = Lfm2ForCausalLM(config).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


def test_cache_specs(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [RECURRENT, FULL, RECURRENT, FULL]
    # conv state: the last L_cache - 1 gated conv inputs, [K - 1, hidden] as in ssm.py
    assert dict(specs[0].fields) == {"conv": (2, 64)}
    assert (specs[1].heads, specs[1].head_dim) == (2, 16)


def test_parity_odd_splits(pair):
    # pieces shorter than the conv window (1, 2 tokens) carry the state across several calls
    model, hf = pair
    check_parity(model, hf, prompt(41, seed=5), chunk=2, decode=5)


