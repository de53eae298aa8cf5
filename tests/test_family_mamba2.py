"""Mamba 2 (SSD mixer on every layer) against transformers' Mamba2ForCausalLM on a tiny random config."""

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from ssm_family_checks import check_parity, check_reuse, greedy, hf_greedy, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import RECURRENT
from turnkv.models import ARCHITECTURES, family_class
from turnkv.models.mamba2 import Mamba2Model

CHUNK = 32  # SSD chunk: the 80-token prompt spans three chunks, the last one partial


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _build(tmp_path_factory)


def _build(tmp_path_factory):
    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                          expand=2, conv_kernel=4, num_hidden_layers=4, chunk_size=CHUNK, use_bias=True,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = Mamba2ForCausalLM(config).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path_factory.mktemp("mamba2"))
    return model, hf


def test_registered():
    assert ARCHITECTURES["mamba2"] == "mamba2:Mamba2Model"
    assert family_class("mamba2") is Mamba2Model


def test_cache_specs_are_named_recurrent_state(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert len(specs) == 4 and all(s.kind == RECURRENT for s in specs)
    # conv keeps the last K-1 conv inputs over x, B and C; ssm is [heads, head_dim, state]
    assert dict(specs[0].fields) == {"conv": (3, 128 + 2 * 2 * 16), "ssm": (8, 16, 16)}


def test_parity_with_transformers(pair):
    model, hf = pair
    diffs = check_parity(model, hf, prompt(80), chunk=7, decode=10)
    print("mamba2 parity", diffs)


def test_parity_chunk_boundary_splits(pair):
    # prefill pieces that straddle and exactly hit the SSD chunk boundary
    model, hf = pair
    diffs = check_parity(model, hf, prompt(70, seed=5), chunk=CHUNK + 1, decode=3)
    assert diffs["many_chunks"] < 1e-4


def test_greedy_matches_generate(pair):
    model, hf = pair
    p = prompt(40, seed=7)
    assert greedy(model, p, 32) == hf_greedy(hf, p, 32)


def test_reuse_is_exact(pair):
    model, _ = pair
    check_reuse(model, prompt(60, seed=11), L=37)


def test_token_by_token_from_the_first_token(pair):
    # every token through the single-step paths, starting from empty state
    model, hf = pair
    check_parity(model, hf, prompt(12, seed=13), chunk=1, decode=11)
