"""Mamba 2 (SSD mixer on every layer) against transformers' Mamba2ForCausalLM on a tiny random config.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import RECURRENT

CHUNK = 32  # SSD chunk: the 80-token prompt spans three chunks, the last one partial


def tiny(tmp_path):
    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                          expand=2, conv_kernel=4, num_hidden_layers=4, chunk_size=CHUNK, use_bias=True,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = Mamba2ForCausalLM(config).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path)
    return model, hf


def test_cache_specs_are_named_recurrent_state(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert len(specs) == 4 and all(s.kind == RECURRENT for s in specs)
    # conv keeps the last K-1 conv inputs over x, B and C; ssm is [heads, head_dim, state]
    assert dict(specs[0].fields) == {"conv": (3, 128 + 2 * 2 * 16), "ssm": (8, 16, 16)}


def test_parity_chunk_boundary_splits(pair):
    # prefill pieces that straddle and exactly hit the SSD chunk boundary
    model, hf = pair
    diffs = check_parity(model, hf, prompt(70, seed=5), chunk=CHUNK + 1, decode=3)
    assert diffs["many_chunks"] < 1e-4


def test_token_by_token_from_the_first_token(pair):
    # every token through the single-step paths, starting from empty state
    model, hf = pair
    check_parity(model, hf, prompt(12, seed=13), chunk=1, decode=11)
