"""RecurrentGemma (RG-LRU recurrent blocks + local sliding-window attention) against transformers'
RecurrentGemmaForCausalLM on a tiny random config.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

from ssm_family_checks import check_parity, fresh, perturb_vectors, run_chunks, save_and_load
from tiny import prompt
from turnkv.cache.specs import RECURRENT, SLIDING

VOCAB = 256
WINDOW = 16  # far shorter than the prompts, so the local attention window really slides


# hidden 80: sqrt(80) is not exact in bfloat16, so the embedding scale rounding is tested
def tiny(tmp_path):
    torch.manual_seed(0)
    config = RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=80, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attention_window_size=WINDOW, conv1d_width=4, logits_soft_cap=5.0,
        attn_implementation="eager")
    hf = RecurrentGemmaForCausalLM(config).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path)
    return model, hf


def test_cache_specs(pair):
    model, _ = pair
    s = model.cache_specs()
    # block pattern recurrent, recurrent, attention repeats over the 4 layers
    assert [x.kind for x in s] == [RECURRENT, RECURRENT, SLIDING, RECURRENT]
    assert dict(s[0].fields) == {"conv": (3, 80), "rg_lru": (80,)}
    assert (s[2].heads, s[2].head_dim, s[2].window) == (2, 20, WINDOW)


def test_parity_chunks_longer_than_window(pair):
    model, hf = pair
    check_parity(model, hf, prompt(75, seed=5), chunk=WINDOW + 3, decode=2)


def test_sliding_layer_snapshot_trims_within_slack(pair):
    # the attention layer's ring keeps slack past the window; the recurrent layers never trim
    model, _ = pair
    caches = fresh(model)
    run_chunks(model, caches, prompt(50), 50)
    snaps = [c.snapshot() for c in caches]
    assert snaps[2].can_restore_to(45)
    assert not any(snaps[i].can_restore_to(45) for i in (0, 1, 3))


def test_token_by_token_from_the_first_token(pair):
    # every token through the single-step paths, starting from empty state
    model, hf = pair
    check_parity(model, hf, prompt(12, seed=13), chunk=1, decode=11)
